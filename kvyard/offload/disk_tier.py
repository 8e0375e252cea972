"""A tier of KV blocks on local disk, found again after a restart.

Blocks are appended to segment files (`*.kvs`, up to `segment_bytes` each) in a directory named by the KV
fingerprint (the model, its dtype and quantization, the KV layout and block size, the hashing scheme): a worker
only ever reads blocks another worker of the same fingerprint wrote. A record is the block's chained
prefix-cache hash (a length byte, then the hash), then the block's bytes as codec.py lays them out. The index
in memory maps a hash to its segment and offset; a new tier on the directory rebuilds it from the records'
headers, up to the first record of a segment that is not whole (a worker stopped in the middle of a write).

Why segments and not a file per block: on the 2-core VM, creating a file per 368 KB SmolLM2 block cost the
writer 0.65-0.74 ms of CPU a block (the inode, its extents, the journal), appending to a segment 0.11-0.12 ms.
With every evicted block written, that difference was the no-reuse benchmark's 4 %.

Writes go through a QueuedWriter (a full queue drops the write and counts it); only its thread appends, and a
block enters the index once its record is whole, so a reader never sees half of one. A block still in the
queue counts as there (a restore plans on it), and a read serves it from the queue's packed row. A missing
segment, or a truncated or corrupt record, is a miss, counted, and the block leaves the index: the request
recomputes.
Capacity: before a record is appended, the least recently used segments (a write or a hit refreshes its
segment) are removed until it fits, so the directory never holds more than its budget. Segments are at most a
sixteenth of it, so eviction drops a small share of the cache at a time.
"""

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvyard.offload.codec import (
    HEADER_SIZE,
    BlockLayout,
    decode_block,
    encode_parts,
    encoded_length,
    unpack_block,
)
from kvyard.offload.host_tier import OnChange, TierBlock, tensors_nbytes
from kvyard.offload.writer import QueuedWriter

log = logging.getLogger(__name__)

SUFFIX = ".kvs"
SEGMENT_BYTES = 32 << 20


def kv_fingerprint(*parts: object) -> str:
    """A short name for everything that decides a block's KV bytes besides its tokens."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


IOV_BATCH = 512  # buffers per writev call (Linux takes at most 1,024)


def _write_all(fd: int, parts: list[bytes | memoryview]) -> None:
    """Write the buffers in order, without joining them into one copy."""
    for i in range(0, len(parts), IOV_BATCH):
        batch = parts[i : i + IOV_BATCH]
        done = os.writev(fd, batch)
        if done != sum(len(part) for part in batch):  # a short write: the rest, a buffer at a time
            _write_rest(fd, batch, done)


def _write_rest(fd: int, parts: list[bytes | memoryview], done: int) -> None:
    """Write what the first `done` bytes of the buffers leave out."""
    for part in parts:
        view = memoryview(part)[max(0, done) :] if done < len(part) else memoryview(b"")
        done -= len(part)
        while len(view):
            view = view[os.write(fd, view) :]


@dataclass
class DiskStats:
    stored: int = 0
    hits: int = 0
    evicted: int = 0
    missing: int = 0  # indexed, but its segment was gone
    corrupt: int = 0  # wrong length, checksum or tokens
    dropped: int = 0  # writes given up because the queue was full
    write_errors: int = 0  # e.g. a full disk


@dataclass
class Segment:
    path: Path
    size: int = 0  # bytes in the file, whole records or not
    blocks: set[bytes] = field(default_factory=set)  # the indexed blocks it holds


@dataclass
class DiskTier:
    root: Path
    capacity_bytes: int
    layout: BlockLayout
    fingerprint: str
    max_pending: int = 256
    name: str = "disk"
    stats: DiskStats = field(default_factory=DiskStats)
    on_change: OnChange | None = None  # called on the writer's thread for writes
    segment_bytes: int = 0  # 0: SEGMENT_BYTES, or a sixteenth of the capacity if that is less

    @property
    def medium(self) -> str:
        return self.name

    def held(self) -> list[bytes]:
        with self._lock:
            return list(self.index)

    def __post_init__(self) -> None:
        self.dir = Path(self.root) / self.fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = self.segment_bytes or min(SEGMENT_BYTES, self.capacity_bytes // 16)
        self._lock = threading.Lock()
        self.index: dict[bytes, tuple[Segment, int, int]] = {}  # hash -> its segment, the offset and length of its bytes
        self.segments: OrderedDict[str, Segment] = OrderedDict()  # by file name, least recently used first
        self.used_bytes = 0
        self._open: Segment | None = None  # the segment the writer appends to
        self._fd = -1
        self._remove_old_format()
        for path in sorted(self.dir.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime):
            self._scan(path)
        self.writer = QueuedWriter(self._write, self.name, self.max_pending, self._write_failed)
        if self.index:
            log.info("disk KV tier %s: %d blocks (%.1f MiB) from before", self.dir, len(self.index),
                     self.used_bytes / 2**20)

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, h: bytes) -> bool:
        with self._lock:
            return h in self.index or h in self.writer.pending

    def lacks(self, h: bytes) -> bool:
        """Whether a write of this block is wanted."""
        return h not in self

    # ---- finding what an earlier worker wrote ----------------------------------------------------------

    def _remove_old_format(self) -> None:
        """A file per block (`*.kv`, before segments) and temporary files: nothing this tier reads."""
        old = [*self.dir.glob("*.kv"), *self.dir.glob("*.tmp")]
        for path in old:
            path.unlink(missing_ok=True)
        if old:
            log.info("disk KV tier %s: removed %d files of an older format", self.dir, len(old))

    def _scan(self, path: Path) -> None:
        """Index a segment's records, up to the first that is not whole."""
        seg = Segment(path, path.stat().st_size)
        with open(path, "rb") as f:
            offset = 0
            while offset < seg.size:
                f.seek(offset)
                head = f.read(1 + 255 + HEADER_SIZE)
                hash_len = head[0]
                length = encoded_length(head[1 + hash_len :])
                if length is None or offset + 1 + hash_len + length > seg.size:
                    break
                self._add(seg, bytes(head[1 : 1 + hash_len]), offset + 1 + hash_len, length)
                offset += 1 + hash_len + length
        self.segments[path.name] = seg
        self.used_bytes += seg.size

    def _add(self, seg: Segment, h: bytes, offset: int, length: int) -> None:
        old = self.index.get(h)
        if old is not None:
            old[0].blocks.discard(h)
        self.index[h] = (seg, offset, length)
        seg.blocks.add(h)

    # ---- writing -------------------------------------------------------------------------------------

    def put(self, h: bytes, tokens: tuple[int, ...], block: torch.Tensor) -> bool:
        """Queue a block for writing; False when the queue is full (dropped, counted)."""
        if h in self:
            return True
        queued = self.writer.submit(h, tokens, block)
        self.stats.dropped = self.writer.dropped
        return queued

    def flush(self) -> None:
        """Wait until every queued write is on disk."""
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
        with self._lock:
            self._close_open()

    def _write_failed(self, e: Exception) -> None:
        self.stats.write_errors += 1
        log.warning("disk KV tier: writing a block failed (%s); it stays uncached", e)

    def _write(self, h: bytes, tokens: tuple[int, ...], block: torch.Tensor) -> None:
        parts = [bytes([len(h)]) + h, *encode_parts(tokens, block)]  # a hash is 32 bytes (sha256)
        size = sum(len(part) for part in parts)
        if size > self.capacity_bytes:
            raise ValueError(f"a block of {size} bytes is larger than the tier's {self.capacity_bytes}")
        with self._lock:
            removed = self._make_room(size)
            seg = self._segment_for(size)
            offset, fd = seg.size, self._fd
            seg.size += size  # counted before the write, so the budget holds while it runs
            self.used_bytes += size
        try:
            _write_all(fd, parts)
        except OSError:
            os.ftruncate(fd, offset)  # e.g. a full disk: no half record left behind
            with self._lock:
                seg.size -= size
                if seg.path.name in self.segments:  # else _lose already took the segment's bytes off the count
                    self.used_bytes -= size
            raise
        with self._lock:
            if seg.path.name in self.segments:  # else it was found missing meanwhile: the block is lost with it
                self._add(seg, h, offset + len(parts[0]), size - len(parts[0]))
                self.segments.move_to_end(seg.path.name)
            self.stats.stored += 1
        if self.on_change is not None:
            self.on_change(self.medium, [h] if h in self.index else [], removed)

    def _make_room(self, size: int) -> list[bytes]:
        """Remove least recently used segments until `size` more bytes fit; the blocks they held."""
        removed: list[bytes] = []
        while self.used_bytes + size > self.capacity_bytes and self.segments:
            _, seg = self.segments.popitem(last=False)
            if seg is self._open:
                self._close_open()
            removed += self._forget(seg)
            self.stats.evicted += len(seg.blocks)
            seg.path.unlink(missing_ok=True)
        return removed

    def _segment_for(self, size: int) -> Segment:
        """The segment to append `size` bytes to: the open one while it has room, else a new one."""
        seg = self._open
        if seg is not None and (seg.path.name not in self.segments or seg.size + size > self.segment_bytes):
            self._close_open()
        if self._open is None:
            path = self.dir / f"{time.time_ns():016x}-{os.getpid()}{SUFFIX}"
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
            self._open = self.segments[path.name] = Segment(path)
        return self._open

    def _close_open(self) -> None:
        if self._open is not None:
            os.close(self._fd)
            self._open, self._fd = None, -1

    def _forget(self, seg: Segment) -> list[bytes]:
        """Take a segment's blocks out of the index and its bytes out of the count; the blocks."""
        for h in seg.blocks:
            self.index.pop(h, None)
        self.used_bytes -= seg.size
        return list(seg.blocks)

    # ---- reading -------------------------------------------------------------------------------------

    def get(self, h: bytes, tokens: tuple[int, ...]) -> TierBlock | None:
        entry = self._entry(h)
        if entry is None:  # `in` counts a block still queued for writing: serve it from the queue
            queued = self.writer.queued(h)
            if queued is not None:
                return self._hit(tokens, unpack_block(queued[2], self.layout) if queued[1] == tokens else None)
            entry = self._entry(h)  # written between the two looks (the index gains it before the queue drops it)
            if entry is None:
                return None
        seg, offset, length = entry
        try:
            fd = os.open(seg.path, os.O_RDONLY)
        except FileNotFoundError:
            return self._lose(seg)
        try:
            data = os.pread(fd, length, offset)
        finally:
            os.close(fd)
        tensors = decode_block(data, tokens, self.layout)  # a short read (a truncated file) fails its checks
        return self._hit(tokens, tensors) if tensors is not None else self._drop(h)

    def _entry(self, h: bytes) -> tuple[Segment, int, int] | None:
        """Where the block is (its segment now the most recently used), or None."""
        with self._lock:
            entry = self.index.get(h)
            if entry is not None:
                self.segments.move_to_end(entry[0].path.name)
            return entry

    def _hit(self, tokens: tuple[int, ...], tensors: list[list[torch.Tensor]] | None) -> TierBlock | None:
        if tensors is None:
            return None
        self.stats.hits += 1
        return TierBlock(tokens, tensors, tensors_nbytes(tensors))

    def _drop(self, h: bytes) -> None:
        """A damaged record, or one of other tokens: the block leaves the index; its bytes stay counted until
        its segment goes."""
        with self._lock:
            entry = self.index.pop(h, None)
            if entry is not None:
                entry[0].blocks.discard(h)
        self.stats.corrupt += 1
        if self.on_change is not None:
            self.on_change(self.medium, [], [h])
        log.warning("disk KV tier: block %s was corrupt; its request recomputes it", h.hex()[:12])
        return None

    def _lose(self, seg: Segment) -> None:
        """A segment removed behind the tier's back: all its blocks are misses."""
        with self._lock:
            gone = self._forget(seg) if self.segments.pop(seg.path.name, None) is not None else []
        self.stats.missing += 1
        if self.on_change is not None and gone:
            self.on_change(self.medium, [], gone)
        log.warning("disk KV tier: segment %s was missing; its requests recompute its %d blocks", seg.path.name,
                    len(gone))
        return None
