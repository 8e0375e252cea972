"""Moves KV blocks between the engine's pool and the tiers below it: host memory (host_tier.py), local disk
(disk_tier.py) and Redis shared by the replicas (redis_tier.py), each optional, looked up in that order. Tiers are inclusive: a block goes to every tier, so each lower one (larger)
adds capacity, and the disk keeps what a restarted worker can use.

- Write-back (default): a cached block that the pool evicts for room is copied to the tiers first; its KV is
  intact until the pool hands the block out, which is right after. Write-through: every block is copied as
  soon as the prefix cache registers it, so the tiers hold what the pool holds too (what a restart needs).
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
from kvyard.offload.disk_tier import DiskTier
from kvyard.offload.host_tier import HostTier, TierBlock
from kvyard.offload.redis_tier import RedisTier

log = logging.getLogger(__name__)


Tier = HostTier | DiskTier | RedisTier
WRITE_POLICIES = ("back", "through")


class KVOffload:
    def __init__(self, tiers: list[Tier], caches: list[LayerKV], blocks: BlockManager, block_size: int,
                 write: str = "back"):
        self.tiers = tiers
        self.caches = caches
        self.blocks = blocks
        self.block_size = block_size
        self.restored = {t.name: 0 for t in tiers}  # blocks put back into the pool, by the tier they came from
        if write == "through":
            blocks.on_store = self.save
        else:
            blocks.on_evict = self.save

    @property
    def restored_blocks(self) -> int:
        return sum(self.restored.values())

    def save(self, block_id: int, h: bytes, tokens: tuple[int, ...]) -> None:
        missing = [t for t in self.tiers if h not in t]
        for t in self.tiers:
            if t not in missing and isinstance(t, HostTier):
                t.entries.move_to_end(h)  # written before and unchanged (a hash names its KV): refresh its place
        if missing:
            tensors = gather_blocks(self.caches, [block_id], self.block_size)  # a copy, which the tiers keep
            for t in missing:
                t.put(h, tokens, tensors)

    def lookup(self, h: bytes, tokens: tuple[int, ...]) -> tuple[TierBlock, Tier] | None:
        for t in self.tiers:
            entry = t.get(h, tokens)
            if entry is not None:
                return entry, t
        return None

    def restore(self, req: Request) -> int:
        """Put the tier's blocks of the request's prompt prefix back into the pool; returns how many."""
        blocks, bs = self.blocks, self.block_size
        if req.needs_prompt_logprobs or req.num_computed_tokens:
            return 0
        hashes = blocks.prompt_hashes(req)
        found: list[tuple[TierBlock, Tier] | None] = []  # per leading block: a tier's copy, None: the pool has it
        for i, h in enumerate(hashes):
            tokens = tuple(req.token_ids[i * bs : (i + 1) * bs])
            b = blocks.cached.get(h)
            if b is not None and blocks.blocks[b].tokens == tokens:
                found.append(None)
                continue
            hit = self.lookup(h, tokens)
            if hit is None:
                break
            found.append(hit)
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
            per_layer = [[torch.cat(parts) for parts in zip(*(e.tensors[layer] for _, (e, _) in fill), strict=True)]
                         for layer in range(len(self.caches))]
            scatter_blocks(self.caches, ids, bs, per_layer)
            blocks.release(ids)
            for _, (_, tier) in fill:
                self.restored[tier.name] += 1
        return len(fill)

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Per tier: blocks restored, stored and evicted, bytes held, and each kind of fallback (kvyard_kv_offload_*)."""
        out = {}
        for t in self.tiers:
            st = t.stats
            fallbacks = {k: getattr(st, k) for k in ("missing", "corrupt", "dropped", "write_errors", "unreachable")
                         if hasattr(st, k)}
            out[t.name] = {"restored": self.restored[t.name], "stored": st.stored, "evicted": st.evicted,
                           "bytes": t.used_bytes, **{"fallback_" + k: v for k, v in fallbacks.items()}}
        return out

    def flush(self) -> None:
        """Wait for the slow tiers' queued writes."""
        for t in self.tiers:
            if not isinstance(t, HostTier):
                t.flush()

    def close(self) -> None:
        for t in self.tiers:
            if not isinstance(t, HostTier):
                t.close()
