"""Grammar masking for a whole batch in one pass, before sampling.

Constrained and unconstrained requests share a batch. Each step, every constrained row's allowed
tokens are written into one int32 bitmask of shape [rows, ceil(vocab / 32)], and xgrammar's kernel
sets the disallowed logits of exactly those rows to -inf, in place. Unconstrained rows are not
touched (the kernel gets their indices left out), so they pay nothing but the Python check.
"""

from collections.abc import Sequence

import torch
import xgrammar as xgr

from kvyard.structured.matcher import GrammarState


def apply_grammar_bitmask(logits: torch.Tensor, states: Sequence[GrammarState | None]) -> list[int]:
    """Mask `logits` rows (one per entry of `states`) whose state is not None; return those rows."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return rows
    vocab = logits.shape[-1]
    # Every bit set means "allowed": rows left unfilled would pass unchanged even if they were masked.
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], vocab)
    for i in rows:
        states[i].fill(bitmask, i)  # type: ignore[union-attr]
    device_mask = bitmask if logits.device.type == "cpu" else bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, device_mask, vocab_size=vocab, indices=rows)
    return rows
