"""A tier of KV blocks in host memory below the engine's pool: a pool of its own, laid out as the engine's caches
are (per layer, per stored tensor, `num_blocks * block_size` rows), so that moving any number of blocks either
way is one row copy per layer and tensor. Blocks are keyed by their chained prefix-cache hash, least recently
used first out; the pool's size is the capacity, so the tier can never hold more.

An entry keeps the block's tokens, and a lookup compares them, so a hash collision can never serve wrong KV
(as in the pool's own prefix cache).
"""

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvyard.engine.kv_handoff import select_blocks
from kvyard.offload.codec import BlockLayout
from kvyard.offload.host_segment import HASH_BYTES, open_segment


@dataclass
class TierBlock:
    """A block read from a tier that stores bytes (disk, Redis)."""

    tokens: tuple[int, ...]
    tensors: list[list[torch.Tensor]]  # per layer, the block's [k, v] (and int8 scales) as the cache stores them
    nbytes: int


# Told which blocks a tier gained and lost (medium, stored, removed): KVOffload turns them into KV events
OnChange = Callable[[str, list[bytes], list[bytes]], None]


def tensors_nbytes(tensors: list[list[torch.Tensor]]) -> int:
    return sum(t.nbytes for layer in tensors for t in layer)


def block_nbytes(layout: BlockLayout) -> int:
    return sum(int(torch.Size(shape).numel()) * dtype.itemsize for layer in layout for shape, dtype in layer)


@dataclass
class TierStats:
    stored: int = 0  # blocks written
    hits: int = 0  # blocks read back
    evicted: int = 0  # blocks dropped for room


@dataclass
class Evicted:
    """Blocks a store pushed out of the host tier, copied out before their slots were overwritten."""

    items: list[tuple[bytes, tuple[int, ...]]]  # (hash, tokens) per block
    tensors: list[list[torch.Tensor]]  # per layer and stored tensor, the blocks one after another


@dataclass
class HostTier:
    capacity_bytes: int
    layout: BlockLayout
    name: str = "host"
    keep_evicted: bool = False  # store() returns what it evicts (exclusive tiers demote it to the next tier)
    stats: TierStats = field(default_factory=TierStats)
    on_change: OnChange | None = None
    segment_path: Path | None = None  # a shared-memory file that outlives the worker (host_segment.py)
    fingerprint: str = ""  # of the model and KV layout: a segment written for another is reset

    @property
    def medium(self) -> str:
        return self.name

    def held(self) -> list[bytes]:
        return list(self.entries)

    def __post_init__(self) -> None:
        self.block_bytes = block_nbytes(self.layout)
        self.block_size = self.layout[0][0][0][0]
        self.num_blocks = self.capacity_bytes // self.block_bytes
        self.entries: OrderedDict[bytes, tuple[int, tuple[int, ...]]] = OrderedDict()  # hash -> (slot, tokens)
        self.segment = None
        if self.segment_path is not None and self.num_blocks:
            self.segment = open_segment(Path(self.segment_path), self.layout, self.num_blocks, self.fingerprint)
        if self.segment is not None:
            self.pool = self.segment.pool
            for slot, h, tokens in self.segment.entries():
                self.entries[h] = (slot, tokens)
            self._tick = int(self.segment.used.max()) + 1
        else:
            # torch.empty: the OS commits pages only as blocks are written, so an unused budget costs nothing
            self.pool = [[torch.empty((self.num_blocks * shape[0], *shape[1:]), dtype=dtype)
                          for shape, dtype in layer] for layer in self.layout]
        taken = {slot for slot, _ in self.entries.values()}
        self.free = [s for s in range(self.num_blocks) if s not in taken]

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, h: bytes) -> bool:
        return h in self.entries

    def lacks(self, h: bytes) -> bool:
        """Whether a write of this block is wanted."""
        return h not in self.entries

    @property
    def used_bytes(self) -> int:
        return len(self.entries) * self.block_bytes

    def _slot(self) -> tuple[int, tuple[bytes, tuple[int, ...]] | None]:
        """A slot to write, and the (hash, tokens) of the block evicted from it, if any."""
        if not self.free:
            h, (slot, tokens) = self.entries.popitem(last=False)
            self.stats.evicted += 1
            return slot, (h, tokens)
        return self.free.pop(), None

    def store(self, items: list[tuple[bytes, tuple[int, ...]]], src: list[list[torch.Tensor]]) -> Evicted | None:
        """Keep blocks i of `src` (per layer, tensors of len(items) blocks) under items[i]'s hash and tokens.
        With keep_evicted, returns the blocks this pushed out, and those it had no room for (else None)."""
        slots, rows, evicted, evicted_slots, overflow = [], [], [], [], []
        for i, (h, tokens) in enumerate(items):
            if h in self.entries:
                self.entries.move_to_end(h)  # unchanged (a hash names its KV): refresh its place only
                continue
            if self.num_blocks == 0 or len(slots) == self.num_blocks:
                overflow.append(i)
                continue
            slot, old = self._slot()
            if old is not None:
                evicted.append(old)
                evicted_slots.append(slot)
            self.entries[h] = (slot, tokens)
            slots.append(slot)
            rows.append(i)
        out = None
        if self.keep_evicted and (evicted or overflow):  # copied out before the new blocks overwrite their slots
            idx = torch.tensor(evicted_slots, dtype=torch.long)
            pushed = [[t.view(-1, self.block_size, *t.shape[1:]).index_select(0, idx).reshape(-1, *t.shape[1:])
                       for t in layer] for layer in self.pool]
            unstored = select_blocks(src, overflow, self.block_size) if overflow else None
            out = Evicted(evicted + [items[i] for i in overflow],
                          pushed if unstored is None else [[torch.cat(pair) for pair in zip(p, u, strict=True)]
                                                           for p, u in zip(pushed, unstored, strict=True)])
        if slots:
            seg = self.segment
            if seg is not None:  # invalid while their KV is being replaced: a crash leaves no false slot
                seg.valid[slots] = 0
            _copy_blocks(src, rows, self.pool, slots, self.block_size)
            if seg is not None:
                self._persist(slots, [items[i] for i in rows])
            self.stats.stored += len(slots)
            if self.on_change is not None:
                self.on_change(self.medium, [items[i][0] for i in rows], [h for h, _ in evicted])
        return out

    def _persist(self, slots: list[int], items: list[tuple[bytes, tuple[int, ...]]]) -> None:
        """Record the slots' hashes and tokens in the segment, then mark them valid."""
        assert self.segment is not None
        seg, idx = self.segment, torch.tensor(slots)
        seg.hashes[idx] = torch.frombuffer(bytearray(b"".join(h for h, _ in items)), dtype=torch.uint8).view(-1, HASH_BYTES)
        seg.tokens[idx] = torch.tensor([t for _, t in items], dtype=torch.int32)
        seg.used[idx] = torch.arange(self._tick, self._tick + len(slots))  # in the order the entries are
        self._tick += len(slots)
        seg.valid[idx] = 1

    def has(self, h: bytes, tokens: tuple[int, ...]) -> bool:
        """Whether this block is here, with these tokens (a hash collision never serves another block's KV)."""
        entry = self.entries.get(h)
        return entry is not None and entry[1] == tokens

    def lookup(self, h: bytes, tokens: tuple[int, ...]) -> int | None:
        """The slot holding this block (now the most recently used), or None."""
        if not self.has(h, tokens):
            return None
        self.entries.move_to_end(h)
        self.stats.hits += 1
        slot = self.entries[h][0]
        if self.segment is not None:
            self.segment.used[slot] = self._tick
            self._tick += 1
        return slot

    def load(self, slots: list[int], dst: list[list[torch.Tensor]], blocks: list[int]) -> None:
        """Copy slots[i] into block blocks[i] of `dst` (the engine's caches, per layer and stored tensor)."""
        _copy_blocks(self.pool, slots, dst, blocks, self.block_size)


def _copy_blocks(src: list[list[torch.Tensor]], src_blocks: list[int], dst: list[list[torch.Tensor]],
                 dst_blocks: list[int], block_size: int) -> None:
    """dst's blocks dst_blocks[i] = src's blocks src_blocks[i], one row copy per layer and tensor."""
    si, di = torch.tensor(src_blocks), torch.tensor(dst_blocks)
    for src_layer, dst_layer in zip(src, dst, strict=True):
        for s, d in zip(src_layer, dst_layer, strict=True):
            blocks = s.view(-1, block_size, *s.shape[1:]).index_select(0, si)
            d.view(-1, block_size, *d.shape[1:]).index_copy_(0, di, blocks)
