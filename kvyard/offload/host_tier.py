"""A tier of KV blocks in host memory below the engine's pool: blocks keyed by their chained prefix-cache hash,
least recently used first out, never more bytes than its capacity.

An entry keeps the block's tokens beside its KV, and a lookup compares them, so a hash collision can never serve
wrong KV (as in the pool's own prefix cache).
"""

from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass
class TierBlock:
    tokens: tuple[int, ...]
    tensors: list[list[torch.Tensor]]  # per layer, the block's [k, v] (and int8 scales) as the cache stores them
    nbytes: int


def tensors_nbytes(tensors: list[list[torch.Tensor]]) -> int:
    return sum(t.nbytes for layer in tensors for t in layer)


@dataclass
class TierStats:
    stored: int = 0  # blocks written
    hits: int = 0  # blocks read back
    evicted: int = 0  # blocks dropped for room
    rejected: int = 0  # blocks larger than the whole tier


@dataclass
class HostTier:
    capacity_bytes: int
    entries: OrderedDict[bytes, TierBlock] = field(default_factory=OrderedDict)  # front = least recently used
    used_bytes: int = 0
    stats: TierStats = field(default_factory=TierStats)
    name: str = "host"

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, h: bytes) -> bool:
        return h in self.entries

    def put(self, h: bytes, tokens: tuple[int, ...], tensors: list[list[torch.Tensor]]) -> bool:
        """Keep a block (a copy the caller no longer writes); False when it cannot fit at all."""
        if h in self.entries:
            self.entries.move_to_end(h)
            return True
        nbytes = tensors_nbytes(tensors)
        if nbytes > self.capacity_bytes:
            self.stats.rejected += 1
            return False
        while self.used_bytes + nbytes > self.capacity_bytes:
            _, old = self.entries.popitem(last=False)
            self.used_bytes -= old.nbytes
            self.stats.evicted += 1
        self.entries[h] = TierBlock(tokens, tensors, nbytes)
        self.used_bytes += nbytes
        self.stats.stored += 1
        return True

    def get(self, h: bytes, tokens: tuple[int, ...]) -> TierBlock | None:
        entry = self.entries.get(h)
        if entry is None or entry.tokens != tokens:
            return None
        self.entries.move_to_end(h)
        self.stats.hits += 1
        return entry
