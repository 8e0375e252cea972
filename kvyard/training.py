"""What kvyard's small training loops share (the speculator's drafter, LoRA adapters, retrofits, grafts):
length-bucketed batches, right-padded inputs, a warmup-then-cosine learning rate, one clipped optimizer step."""

import math
import random
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def batches(samples: list[T], batch_tokens: int, rng: random.Random, length: Callable[[T], int]) -> list[list[T]]:
    """Samples of similar length together, at most `batch_tokens` padded tokens per batch, in random order."""
    ordered = sorted(samples, key=length)
    out: list[list[T]] = []
    cur: list[T] = []
    for s in ordered:
        if cur and (len(cur) + 1) * length(s) > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(s)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def right_pad(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id rows as one right-padded [rows, longest] tensor, and its attention mask."""
    ids = torch.full((len(rows), max(len(r) for r in rows)), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


def warmup_cosine(opt: torch.optim.Optimizer, total: int, warmup: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A linear warmup over `warmup` steps, then a cosine decay to zero at step `total`."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))


def step(loss: torch.Tensor, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
         params: list[torch.Tensor]) -> float:
    """Backpropagate `loss`, clip the gradients' norm to 1, step; returns the loss."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()
    return loss.item()
