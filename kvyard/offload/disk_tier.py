"""A tier of KV blocks in files on local disk, found again after a restart.

One file per block, named by its chained prefix-cache hash, in a directory named by the KV fingerprint (the
model, its dtype and quantization, the KV layout and block size, the hashing scheme): a worker only ever reads
blocks another worker of the same fingerprint wrote. A file holds a header (magic, token count, CRC-32 and
length of the body), the block's tokens and its KV bytes as the cache stores them.

Writes go through a bounded queue to one writer thread (a full queue drops the write and counts it), to a
temporary name that is renamed into place, so a reader never sees half a file. A missing, truncated or corrupt
file (length or CRC-32 wrong, other tokens) is a miss, counted, and the file removed: the request recomputes.
The directory stays within its capacity by removing the least recently used files.
"""

import hashlib
import logging
import os
import queue
import struct
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvyard.offload.host_tier import TierBlock, tensors_nbytes

log = logging.getLogger(__name__)

MAGIC = b"KVYD1"
_HEADER = struct.Struct("<5sIIQ")  # magic, tokens, crc32(body), len(body)
SUFFIX = ".kv"

# Per layer, per stored tensor: the shape and dtype of one block of it.
BlockLayout = list[list[tuple[tuple[int, ...], torch.dtype]]]


def kv_fingerprint(*parts: object) -> str:
    """A short name for everything that decides a block's KV bytes besides its tokens."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


@dataclass
class DiskStats:
    stored: int = 0
    hits: int = 0
    evicted: int = 0
    missing: int = 0  # indexed, but the file was gone
    corrupt: int = 0  # wrong length, CRC-32 or tokens
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

    def __post_init__(self) -> None:
        self.dir = Path(self.root) / self.fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, least recently used first
        self.used_bytes = 0
        files = sorted(self.dir.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                h = bytes.fromhex(path.stem)
            except ValueError:
                continue
            self.index[h] = path.stat().st_size
            self.used_bytes += self.index[h]
        self._pending: set[bytes] = set()
        self._queue: queue.Queue[tuple[bytes, tuple[int, ...], list[list[torch.Tensor]]] | None] = queue.Queue(
            self.max_pending)
        self._writer = threading.Thread(target=self._write_loop, name="kvyard-kv-disk", daemon=True)
        self._writer.start()
        if self.index:
            log.info("disk KV tier %s: %d blocks (%.1f MiB) from before", self.dir, len(self.index),
                     self.used_bytes / 2**20)

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, h: bytes) -> bool:
        with self._lock:
            return h in self.index or h in self._pending

    def _path(self, h: bytes) -> Path:
        return self.dir / (h.hex() + SUFFIX)

    # ---- writing -------------------------------------------------------------------------------------

    def put(self, h: bytes, tokens: tuple[int, ...], tensors: list[list[torch.Tensor]]) -> bool:
        """Queue a block for writing (tensors the caller no longer writes); False when the queue is full."""
        with self._lock:
            if h in self.index or h in self._pending:
                return True
            self._pending.add(h)
        try:
            self._queue.put_nowait((h, tokens, tensors))
        except queue.Full:
            with self._lock:
                self._pending.discard(h)
            self.stats.dropped += 1
            return False
        return True

    def flush(self) -> None:
        """Wait until every queued write is on disk."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(timeout=10)

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            h, tokens, tensors = item
            try:
                self._write(h, tokens, tensors)
            except OSError as e:
                self.stats.write_errors += 1
                log.warning("disk KV tier: writing a block failed (%s); it stays uncached", e)
            finally:
                with self._lock:
                    self._pending.discard(h)
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, h: bytes, tokens: tuple[int, ...], tensors: list[list[torch.Tensor]]) -> None:
        body = np.asarray(tokens, dtype=np.int64).tobytes() + b"".join(
            t.contiguous().view(torch.uint8).numpy().tobytes() for layer in tensors for t in layer)
        data = _HEADER.pack(MAGIC, len(tokens), zlib.crc32(body), len(body)) + body
        path = self._path(h)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        with self._lock:
            self.index[h] = len(data)
            self.used_bytes += len(data)
            self.stats.stored += 1
            while self.used_bytes > self.capacity_bytes and self.index:
                old, size = self.index.popitem(last=False)
                self.used_bytes -= size
                self.stats.evicted += 1
                self._path(old).unlink(missing_ok=True)

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
        tensors = self._decode(data, tokens)
        if tensors is None:
            return self._drop(h, "corrupt")
        self.stats.hits += 1
        return TierBlock(tokens, tensors, tensors_nbytes(tensors))

    def _decode(self, data: bytes, tokens: tuple[int, ...]) -> list[list[torch.Tensor]] | None:
        if len(data) < _HEADER.size:
            return None
        magic, n, crc, length = _HEADER.unpack_from(data)
        body = data[_HEADER.size :]
        if magic != MAGIC or len(body) != length or zlib.crc32(body) != crc or n != len(tokens):
            return None
        if tuple(np.frombuffer(body, dtype=np.int64, count=n).tolist()) != tokens:
            return None
        offset, out = 8 * n, []
        for layer in self.layout:
            tensors = []
            for shape, dtype in layer:
                size = int(np.prod(shape)) * dtype.itemsize
                if offset + size > len(body):
                    return None
                raw = torch.frombuffer(bytearray(body[offset : offset + size]), dtype=torch.uint8)
                tensors.append(raw.view(dtype).view(shape))
                offset += size
            out.append(tensors)
        return out if offset == len(body) else None

    def _drop(self, h: bytes, why: str) -> None:
        with self._lock:
            size = self.index.pop(h, 0)
            self.used_bytes -= size
        setattr(self.stats, why, getattr(self.stats, why) + 1)
        self._path(h).unlink(missing_ok=True)
        log.warning("disk KV tier: block %s was %s; its request recomputes it", h.hex()[:12], why)
        return None
