"""Moves KV blocks between the engine's pool and the tier below it (kvyard/offload/host_tier.py).

- Write-back: a cached block that the pool evicts for room is copied to the tier first; its KV is intact until
  the pool hands the block out, which is right after.
- Restore: before a request is admitted, the blocks of its prompt that follow the pool's own cached prefix and
  are in the tier go back into the pool's prefix cache (`BlockManager.adopt`), so the scheduler hits them like
  any cached prefix and the request computes only what neither holds. The pool's KV events report them as
  stored, so a cache-aware router sees them too.
"""

import logging

import torch

from kvyard.disagg.blocks import gather_blocks, scatter_blocks
from kvyard.engine.block_manager import BlockManager
from kvyard.engine.request import Request
from kvyard.models.kv_layer import LayerKV
from kvyard.offload.host_tier import HostTier, TierBlock

log = logging.getLogger(__name__)


class KVOffload:
    def __init__(self, tier: HostTier, caches: list[LayerKV], blocks: BlockManager, block_size: int):
        self.tier = tier
        self.caches = caches
        self.blocks = blocks
        self.block_size = block_size
        self.restored_blocks = 0
        blocks.on_evict = self.save

    def save(self, block_id: int, h: bytes, tokens: tuple[int, ...]) -> None:
        if h in self.tier:  # written before and unchanged (a hash names its KV): only refresh its place
            self.tier.entries.move_to_end(h)
            return
        self.tier.put(h, tokens, gather_blocks(self.caches, [block_id], self.block_size))

    def restore(self, req: Request) -> int:
        """Put the tier's blocks of the request's prompt prefix back into the pool; returns how many."""
        blocks, bs = self.blocks, self.block_size
        if req.needs_prompt_logprobs or req.num_computed_tokens:
            return 0
        hashes = blocks.prompt_hashes(req)
        found: list[TierBlock | None] = []  # per leading block: the tier's copy, or None where the pool has it
        for i, h in enumerate(hashes):
            tokens = tuple(req.token_ids[i * bs : (i + 1) * bs])
            b = blocks.cached.get(h)
            if b is not None and blocks.blocks[b].tokens == tokens:
                found.append(None)
                continue
            entry = self.tier.get(h, tokens)
            if entry is None:
                break
            found.append(entry)
        while found and found[-1] is None:
            found.pop()  # what the pool holds after the tier's last block needs no restoring
        if not any(e is not None for e in found):
            return 0
        n = len(found)
        taken = blocks.adopt(req.token_ids[: n * bs], hashes[:n])
        # A block the pool held when we looked may have been evicted by adopt itself: no copy of it here.
        lost = [b for i, b in taken if found[i] is None]
        fill = [(b, found[i]) for i, b in taken if found[i] is not None]
        if lost:
            blocks.forget(lost)
            blocks.release(lost)
        if fill:
            ids = [b for b, _ in fill]
            per_layer = [[torch.cat(parts) for parts in zip(*(e.tensors[layer] for _, e in fill), strict=True)]
                         for layer in range(len(self.caches))]
            scatter_blocks(self.caches, ids, bs, per_layer)
            blocks.release(ids)
            self.restored_blocks += len(ids)
        return len(fill)
