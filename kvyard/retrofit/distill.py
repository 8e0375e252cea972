"""Distilling a converted model back toward the original (`kvyard retrofit --distill-minutes M`).

The data is the speculator's (kvyard/spec/speculator/distill.py): the original model, run by kvyard's engine,
answers kvyard's chat prompts greedily and gives its top-20 logprobs at every output position. The converted
model is taught those distributions, teacher-forced on the original's tokens: the cross-entropy against the
top-20 renormalised, which is the KL on them up to a constant. Only the converted attention's projections
train (k_proj and v_proj by default; `attention`: q, k, v and o), the rest stays as it was. Training stops at
the end of its epochs or of its time budget, whichever comes first.
"""

import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from kvyard.spec.speculator.distill import Sample
from kvyard.training import batches, right_pad, step, warmup_cosine

TRAINED = {"kv": ("k_proj", "v_proj"), "attention": ("q_proj", "k_proj", "v_proj", "o_proj")}


@dataclass
class DistillSettings:
    minutes: float = 30.0  # the time budget
    epochs: int = 2
    lr: float = 2e-4
    batch_tokens: int = 1024
    train: str = "kv"  # which projections train: kv or attention
    seed: int = 0
    progress: bool = True


def trainable(model: Any, which: str) -> list[torch.nn.Parameter]:
    """Freeze everything but the chosen attention projections; returns those."""
    params = []
    for name, p in model.named_parameters():
        p.requires_grad_(any(f"self_attn.{proj}." in name for proj in TRAINED[which]))
        if p.requires_grad:
            params.append(p)
    return params


def soft_loss(model: Any, batch: list[Sample]) -> torch.Tensor:
    """Cross-entropy of the model's next-token distributions against the original's top-20, renormalised,
    at every output position (the logits before each output token)."""
    ids, mask = right_pad([s.token_ids for s in batch])
    logits = model(input_ids=ids, attention_mask=mask).logits
    rows = torch.cat([logits[r, s.prompt_len - 1 : s.prompt_len - 1 + s.num_output] for r, s in enumerate(batch)])
    logp = rows.float().log_softmax(-1)
    top_ids = torch.from_numpy(np.concatenate([s.top_ids for s in batch]))
    probs = torch.from_numpy(np.concatenate([s.top_logprobs for s in batch])).exp()
    probs = probs / probs.sum(-1, keepdim=True)
    return -(probs * logp.gather(1, top_ids)).sum(-1).mean()


def distill_back(model: Any, samples: list[Sample], s: DistillSettings) -> dict[str, Any]:
    rng = random.Random(s.seed)
    params = trainable(model, s.train)
    plan = [b for _ in range(s.epochs) for b in batches(samples, s.batch_tokens, rng, lambda x: len(x.token_ids))]
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.0)
    sched = warmup_cosine(opt, len(plan), max(1, len(plan) // 20))
    model.train()
    losses: list[float] = []
    started = time.perf_counter()
    bar = tqdm(plan, desc="retrofit distill", disable=not s.progress)
    for batch in bar:
        if time.perf_counter() - started > 60 * s.minutes:
            break
        losses.append(step(soft_loss(model, batch), opt, sched, params))
        bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")
    bar.close()
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return {"steps": len(losses), "planned_steps": len(plan), "seconds": round(time.perf_counter() - started, 1),
            "first_loss": losses[0] if losses else None,
            "last_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
            "trained": list(TRAINED[s.train]), "trained_parameters": sum(p.numel() for p in params)}
