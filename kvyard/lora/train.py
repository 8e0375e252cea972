"""`kvyard lora train`: fit a LoRA adapter to captured traffic or a chat file, and save it in PEFT's format.

The base is the model kvyard serves, read by kvyard's loader (a GGUF file dequantized as the engine does) into
HF transformers, with PEFT's LoRA layers on the target modules; only those train. The loss is the completion's
tokens' cross-entropy (the prompt's positions are masked). Objectives:
- `sft`: the completions in the file (optionally only the chosen ones: `--keep json`);
- `distill`: a teacher model's greedy answers to the same prompts, the teacher seeing each prompt whole and the
  student without the `--drop` texts: a larger model's behaviour, or a system prompt's, folded into the adapter.
A share of the examples is held out: their loss and next-token accuracy are measured before and after training.
The output directory holds `adapter_config.json`, `adapter_model.safetensors` (which HF `peft` loads too) and
`train_report.json`; kvyard's own adapter reader checks it before the command returns.
"""

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvyard.errors import InvalidRequestError
from kvyard.lora.data import KEEP, Example, read_examples, split
from kvyard.training import batches, right_pad, step, warmup_cosine

DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@dataclass
class TrainSettings:
    model: str  # the base: a model name, HF directory or .gguf file
    data: str  # JSON lines (kvyard/lora/data.py)
    out: str  # the adapter's directory
    objective: str = "sft"  # or "distill"
    teacher: str | None = None  # distill: the model whose answers are learned (default: the base itself)
    max_new_tokens: int = 128  # distill: the teacher's answer length
    drop: list[str] = field(default_factory=list)  # texts removed from the student's prompts
    keep: str = "all"  # which completions are chosen: all, or only those that are JSON
    rank: int = 8
    alpha: float = 16.0
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    epochs: int = 3
    lr: float = 1e-3
    batch_tokens: int = 512  # padded tokens per optimizer step (small: more steps from a few hundred examples)
    held_out: float = 0.1  # the share of examples evaluated, never trained on
    seed: int = 0
    bf16: bool = False  # autocast the base's matmuls to bfloat16 (faster where the CPU has AMX or AVX512-BF16)
    progress: bool = True

    def __post_init__(self) -> None:
        for name, ok in (("objective", self.objective in ("sft", "distill")), ("keep", self.keep in KEEP),
                         ("rank", self.rank >= 1), ("epochs", self.epochs >= 1), ("lr", self.lr > 0),
                         ("held_out", 0 <= self.held_out < 1), ("batch_tokens", self.batch_tokens >= 16)):
            if not ok:
                raise InvalidRequestError(f"lora train: {name} is out of range: {getattr(self, name)!r}", param=name)


@dataclass
class Evaluation:
    loss: float  # mean cross-entropy over the held-out completions' tokens
    accuracy: float  # share of those tokens that are the argmax given the reference prefix


def train_adapter(s: TrainSettings) -> dict[str, Any]:
    import peft

    from kvyard.loader.checkpoint import load_checkpoint
    from kvyard.loader.hf_model import hf_causal_lm
    from kvyard.loader.registry import resolve_model
    from kvyard.lora.adapter import load_adapter

    torch.manual_seed(s.seed)
    started = time.perf_counter()
    ckpt = load_checkpoint(resolve_model(s.model))
    examples = training_examples(s, ckpt.tokenizer)
    train, held = split(examples, s.held_out, s.seed)
    base = hf_causal_lm(ckpt.hf_config, {name: t.float() for name, t in ckpt.tensors()})
    config = peft.LoraConfig(r=s.rank, lora_alpha=s.alpha, target_modules=s.targets, lora_dropout=0.0,
                             task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, config)
    pad = ckpt.tokenizer.pad_token_id if ckpt.tokenizer.pad_token_id is not None else 0
    before = evaluate(model, held, pad, s.bf16)
    losses = fit(model, train, s, pad)
    after = evaluate(model, held, pad, s.bf16)
    out = Path(s.out).expanduser()
    model.peft_config["default"].base_model_name_or_path = str(ckpt.path)
    model.save_pretrained(out, save_embedding_layers=False)
    load_adapter(out.name, out, ckpt.config)  # the engine reads it (the shapes and targets check out) before we report
    report = {"settings": asdict(s), "base": str(ckpt.path), "examples": {"train": len(train), "held_out": len(held)},
              "train_tokens": sum(len(e.completion_ids) for e in train), "steps": len(losses),
              "first_loss": losses[0], "last_loss": sum(losses[-5:]) / len(losses[-5:]),
              "held_out_before": asdict(before) if before else None,
              "held_out_after": asdict(after) if after else None,
              "seconds": round(time.perf_counter() - started, 1)}
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def training_examples(s: TrainSettings, tokenizer: Any) -> list[Example]:
    examples = read_examples(s.data, tokenizer, tuple(s.drop))
    if s.objective == "distill":
        examples = _teacher_answers(s, examples, tokenizer)
    chosen = [e for e in examples if KEEP[s.keep](e.completion) and e.completion_ids]
    if len(chosen) < 2:
        raise InvalidRequestError(f"{s.data}: {len(chosen)} of {len(examples)} examples are kept (--keep {s.keep}); "
                                  "at least 2 are needed", param="data")
    return chosen


def _teacher_answers(s: TrainSettings, students: list[Example], tokenizer: Any) -> list[Example]:
    """The student's prompts with the teacher's greedy answers, the teacher reading the prompts whole."""
    from kvyard.llm import LLM
    from kvyard.sampling_params import SamplingParams

    teacher = LLM(s.teacher or s.model, dtype="float32")
    prompts = [e.prompt_ids for e in read_examples(s.data, teacher.tokenizer)]
    outputs = teacher.generate(prompts, SamplingParams(max_tokens=s.max_new_tokens, temperature=0.0),
                               use_tqdm=s.progress)
    teacher.close()
    out = []
    for student, answer in zip(students, outputs, strict=True):
        text = answer.outputs[0].text
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if answer.outputs[0].finish_reason == "stop" and tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        out.append(Example(student.prompt_ids, ids, text))
    return out


def _batch(examples: list[Example], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, their attention mask, and labels that are -100 except on the completions' tokens."""
    ids, mask = right_pad([e.prompt_ids + e.completion_ids for e in examples], pad)
    labels = torch.full_like(ids, -100)
    for row, e in enumerate(examples):
        p, n = len(e.prompt_ids), len(e.prompt_ids) + len(e.completion_ids)
        labels[row, p:n] = ids[row, p:n]
    return ids, mask, labels


def _logits(model: Any, ids: torch.Tensor, mask: torch.Tensor, bf16: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return model(input_ids=ids, attention_mask=mask).logits.float()


def _token_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per completion token (shifted: position t predicts token t+1): the cross-entropy and whether argmax hit."""
    logits, labels = logits[:, :-1], labels[:, 1:]
    kept = labels != -100
    chosen, targets = logits[kept], labels[kept]
    return torch.nn.functional.cross_entropy(chosen, targets, reduction="none"), chosen.argmax(-1) == targets


def fit(model: Any, train: list[Example], s: TrainSettings, pad: int) -> list[float]:
    rng = random.Random(s.seed)
    length = lambda e: len(e.prompt_ids) + len(e.completion_ids)  # noqa: E731
    plan = [b for _ in range(s.epochs) for b in batches(train, s.batch_tokens, rng, length)]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.0)
    warmup = max(1, len(plan) // 10)
    sched = warmup_cosine(opt, len(plan), warmup)
    model.train()
    losses: list[float] = []
    bar = tqdm(plan, desc="lora train", disable=not s.progress)
    for batch in bar:
        ids, mask, labels = _batch(batch, pad)
        losses.append(step(_token_loss(_logits(model, ids, mask, s.bf16), labels)[0].mean(), opt, sched, params))
        bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")
    model.eval()
    return losses


@torch.no_grad()
def evaluate(model: Any, held: list[Example], pad: int, bf16: bool = False, batch: int = 8) -> Evaluation | None:
    if not held:
        return None
    losses, hits = [], []
    for start in range(0, len(held), batch):
        ids, mask, labels = _batch(held[start : start + batch], pad)
        loss, hit = _token_loss(_logits(model, ids, mask, bf16), labels)
        losses.append(loss)
        hits.append(hit)
    return Evaluation(loss=round(torch.cat(losses).mean().item(), 4),
                      accuracy=round(torch.cat(hits).float().mean().item(), 4))
