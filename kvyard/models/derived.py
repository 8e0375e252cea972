"""What the tools that derive a checkpoint from another share (kvyard moe split, kvyard retrofit): the original's
own greedy continuations as evaluation text, the next-token divergence of a derived model from the original,
and writing the result as an HF checkpoint directory that kvyard and transformers both read."""

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

SPEC_DATA = Path(__file__).resolve().parent.parent / "bench" / "spec_data"


def original_texts(tokenizer: Any, model: Any, count: int, offset: int = 0, new_tokens: int = 48) -> list[list[int]]:
    """Token ids of chat prompts from kvyard's own data (from `offset` on), each followed by `model`'s greedy
    continuation: text in the original's own distribution."""
    prompts = [json.loads(line)["prompt"] for name in ("chat_train.jsonl", "chat_eval.jsonl")
               for line in (SPEC_DATA / name).read_text().splitlines() if line.strip()][offset:][:count]
    out = []
    for text in prompts:
        ids = torch.tensor([tokenizer(text).input_ids])
        with torch.no_grad():
            full = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  do_sample=False, pad_token_id=0)
        out.append(full[0].tolist())
    return out


def divergence(original: Any, derived: Any, texts: list[list[int]]) -> dict[str, float]:
    """Mean KL(original || derived) of the next-token distributions over every position, and top-1 agreement."""
    kl, agree, n = 0.0, 0, 0
    with torch.no_grad():
        for ids in texts:
            x = torch.tensor([ids])
            p, q = F.log_softmax(original(x).logits[0].float(), -1), F.log_softmax(derived(x).logits[0].float(), -1)
            kl += float(F.kl_div(q, p, log_target=True, reduction="sum"))
            agree += int((p.argmax(-1) == q.argmax(-1)).sum())
            n += len(ids)
    return {"eval_tokens": n, "kl_mean": kl / n if n else math.nan, "top1_agreement": agree / n if n else math.nan}


def save_checkpoint(out: Path, config: dict[str, Any], weights: dict[str, torch.Tensor], tokenizer: Any) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    if config.get("tie_word_embeddings"):
        weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(str(out))
