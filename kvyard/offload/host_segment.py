"""The host tier's pool in a shared-memory file, so that a restarted worker finds its blocks again.

The file (by default `/dev/shm/kvyard-kv-<fingerprint>`: the model and its KV layout) holds a header, then per
slot a valid flag, the block's hash, its tokens and a last-use tick, then the pool's tensors laid out as in a
private host tier. The file is mapped, so the tier's row copies write it directly and nothing is serialised.

- A slot is marked invalid before its KV is overwritten and valid only once KV, hash and tokens are in, so a
  worker killed mid-copy leaves no slot that claims KV it does not hold.
- One worker at a time: the file is locked (flock) while open, and the lock dies with its process. A second
  worker on the same machine and model falls back to private memory, as does a worker without the room in the
  segment's filesystem (a container's /dev/shm is often 64 MiB) or on a system without one.
- A file with another header (another layout, size or version) is reset, never read.
- The segment outlives the worker by design: it holds its memory until deleted (`rm /dev/shm/kvyard-kv-*`).
"""

import fcntl
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kvyard.offload.codec import BlockLayout

log = logging.getLogger(__name__)

MAGIC = b"kvyard-kv-segment-1"
HEADER_BYTES = 4096
HASH_BYTES = 32  # sha256 block hashes (kvyard/engine/block_manager.py)
ALIGN = 64


@dataclass
class Segment:
    path: Path
    fd: int  # open and locked while the segment is in use
    pool: list[list[torch.Tensor]]  # per layer and stored tensor, num_blocks * block_size rows
    valid: torch.Tensor  # uint8 [num_blocks]
    hashes: torch.Tensor  # uint8 [num_blocks, HASH_BYTES]
    tokens: torch.Tensor  # int32 [num_blocks, block_size]
    used: torch.Tensor  # int64 [num_blocks]: last-use tick, for the LRU order after a restart

    def entries(self) -> list[tuple[int, bytes, tuple[int, ...]]]:
        """(slot, hash, tokens) of the valid slots, least recently used first."""
        slots = [int(s) for s in torch.nonzero(self.valid).flatten()]
        slots.sort(key=lambda s: int(self.used[s]))
        return [(s, bytes(self.hashes[s].tolist()), tuple(self.tokens[s].tolist())) for s in slots]

    def close(self) -> None:
        os.close(self.fd)  # releases the lock


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _plan(layout: BlockLayout, num_blocks: int, block_size: int) -> tuple[list[int], int]:
    """Byte offsets of valid, hashes, tokens, used and each pool tensor; and the file's size."""
    offsets, at = [], HEADER_BYTES
    for nbytes in (num_blocks, num_blocks * HASH_BYTES, num_blocks * block_size * 4, num_blocks * 8):
        offsets.append(at)
        at += _aligned(nbytes)
    for layer in layout:
        for shape, dtype in layer:
            offsets.append(at)
            at += _aligned(num_blocks * int(torch.Size(shape).numel()) * dtype.itemsize)
    return offsets, at


def _header(layout: BlockLayout, num_blocks: int, fingerprint: str) -> bytes:
    text = MAGIC + repr((fingerprint, num_blocks, [[(tuple(s), str(d)) for s, d in layer] for layer in layout])).encode()
    if len(text) > HEADER_BYTES - 8:
        raise ValueError("the KV layout is too long for a segment header")
    return len(text).to_bytes(8, "little") + text


def open_segment(path: Path, layout: BlockLayout, num_blocks: int, fingerprint: str) -> Segment | None:
    """Map (creating or resetting it if needed) the segment for this layout, or None where that cannot be done."""
    block_size = layout[0][0][0][0]
    offsets, size = _plan(layout, num_blocks, block_size)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        log.info("host KV tier in private memory: cannot open %s (%s)", path, e)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        log.info("host KV tier in private memory: another worker holds %s", path)
        return None
    have = os.fstat(fd).st_size
    stats = os.statvfs(path.parent)
    if size > have and (size - have) > stats.f_bavail * stats.f_frsize:
        os.close(fd)
        log.info("host KV tier in private memory: %s has no room for %.1f MiB", path.parent, size / 2**20)
        return None
    header = _header(layout, num_blocks, fingerprint)
    fresh = have != size or os.pread(fd, len(header), 0) != header
    if fresh:
        os.ftruncate(fd, 0)  # drop whatever was there: its blocks are not ours
        os.ftruncate(fd, size)
        os.pwrite(fd, header, 0)
    buf = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)

    def view(offset: int, count: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return buf[offset : offset + count * dtype.itemsize].view(dtype).view(shape)

    pool, i = [], 4
    for layer in layout:
        tensors = []
        for shape, dtype in layer:
            rows = (num_blocks * shape[0], *shape[1:])
            tensors.append(view(offsets[i], int(torch.Size(rows).numel()), dtype, rows))
            i += 1
        pool.append(tensors)
    seg = Segment(path, fd, pool, view(offsets[0], num_blocks, torch.uint8, (num_blocks,)),
                  view(offsets[1], num_blocks * HASH_BYTES, torch.uint8, (num_blocks, HASH_BYTES)),
                  view(offsets[2], num_blocks * block_size, torch.int32, (num_blocks, block_size)),
                  view(offsets[3], num_blocks, torch.int64, (num_blocks,)))
    if not fresh:
        log.info("host KV tier: %d blocks in %s from before", int(seg.valid.sum()), path)
    return seg
