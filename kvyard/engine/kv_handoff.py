"""KV handed between workers (prefill/decode disaggregation), as the engine sees it.

A prefill worker runs the prompt as an ordinary request that asks to keep its KV (`hold_kv`): when it
finishes, its full blocks stay referenced as a `HeldKV` until the decode worker has pulled them and the
transfer layer (kvyard/disagg/) says so. The decode worker adopts received blocks into its prefix cache
(`BlockManager.adopt`), so the request that follows simply hits them: no special scheduling state, and a
request that cannot use them (evicted, preempted) recomputes, which is always correct.
"""

from dataclasses import dataclass

import torch


@dataclass
class HeldKV:
    request_id: str
    block_ids: list[int]  # referenced by the hold, never written while held
    block_hashes: list[bytes]  # the chained prefix-cache hashes of those blocks
    token_ids: list[int]  # the tokens they hold KV for: len(block_ids) * block_size


def select_blocks(tensors: list[list[torch.Tensor]], indices: list[int], block_size: int) -> list[list[torch.Tensor]]:
    """Per layer, the rows of the given block indices out of tensors laid out block after block."""
    if indices == list(range(indices[0], indices[0] + len(indices))):  # the usual case: one contiguous run
        lo, hi = indices[0] * block_size, (indices[-1] + 1) * block_size
        return [[t[lo:hi] for t in layer] for layer in tensors]
    idx = torch.tensor(indices)

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.view(-1, block_size, *t.shape[1:]).index_select(0, idx).reshape(-1, *t.shape[1:])

    return [[pick(t) for t in layer] for layer in tensors]
