"""A tier of KV blocks in files on local disk, found again after a restart.

One file per block, named by its chained prefix-cache hash, in a directory named by the KV fingerprint (the
model, its dtype and quantization, the KV layout and block size, the hashing scheme): a worker only ever reads
blocks another worker of the same fingerprint wrote. A file is the block's bytes as codec.py lays them out.

Writes go through a QueuedWriter (a full queue drops the write and counts it), to a temporary name that is
renamed into place, so a reader never sees half a file. A missing, truncated or corrupt file is a miss, counted,
and the file removed: the request recomputes. The directory stays within its capacity by removing the least
recently used files.
"""

import hashlib
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvyard.offload.codec import BlockLayout, decode_block, encode_parts
from kvyard.offload.host_tier import OnChange, TierBlock, tensors_nbytes
from kvyard.offload.writer import QueuedWriter

log = logging.getLogger(__name__)

SUFFIX = ".kv"


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
    missing: int = 0  # indexed, but the file was gone
    corrupt: int = 0  # wrong length, checksum or tokens
    dropped: int = 0  # writes given up because the queue was full
    write_errors: int = 0  # e.g. a full disk


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

    @property
    def medium(self) -> str:
        return self.name

    def held(self) -> list[bytes]:
        with self._lock:
            return list(self.index)

    def __post_init__(self) -> None:
        self.dir = Path(self.root) / self.fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, least recently used first
        self.used_bytes = 0
        for path in sorted(self.dir.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime):
            try:
                h = bytes.fromhex(path.stem)
            except ValueError:
                continue
            self.index[h] = path.stat().st_size
            self.used_bytes += self.index[h]
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

    def _path(self, h: bytes) -> Path:
        return self.dir / (h.hex() + SUFFIX)

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

    def _write_failed(self, e: Exception) -> None:
        self.stats.write_errors += 1
        log.warning("disk KV tier: writing a block failed (%s); it stays uncached", e)

    def _write(self, h: bytes, tokens: tuple[int, ...], block: torch.Tensor) -> None:
        parts = encode_parts(tokens, block)
        size = sum(len(part) for part in parts)
        path = self._path(h)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, parts)
        except OSError:
            tmp.unlink(missing_ok=True)  # e.g. a full disk: no half file left behind
            raise
        finally:
            os.close(fd)
        os.replace(tmp, path)
        with self._lock:
            self.index[h] = size
            self.used_bytes += size
            self.stats.stored += 1
            removed = []
            while self.used_bytes > self.capacity_bytes and self.index:
                old, size = self.index.popitem(last=False)
                self.used_bytes -= size
                self.stats.evicted += 1
                self._path(old).unlink(missing_ok=True)
                removed.append(old)
        if self.on_change is not None:
            self.on_change(self.medium, [h] if h in self.index else [], removed)

    # ---- reading -------------------------------------------------------------------------------------

    def get(self, h: bytes, tokens: tuple[int, ...]) -> TierBlock | None:
        with self._lock:
            if h not in self.index:
                return None
            self.index.move_to_end(h)
        try:
            data = self._path(h).read_bytes()
        except FileNotFoundError:
            return self._drop(h, "missing")
        tensors = decode_block(data, tokens, self.layout)
        if tensors is None:
            return self._drop(h, "corrupt")
        self.stats.hits += 1
        return TierBlock(tokens, tensors, tensors_nbytes(tensors))

    def _drop(self, h: bytes, why: str) -> None:
        with self._lock:
            self.used_bytes -= self.index.pop(h, 0)
        setattr(self.stats, why, getattr(self.stats, why) + 1)
        self._path(h).unlink(missing_ok=True)
        if self.on_change is not None:
            self.on_change(self.medium, [], [h])
        log.warning("disk KV tier: block %s was %s; its request recomputes it", h.hex()[:12], why)
        return None
