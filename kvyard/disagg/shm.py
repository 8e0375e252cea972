"""Shared-memory segments for a transfer between two processes on one host.

The source owns each segment: it creates it when a same-host fetcher asks, gathers the blocks straight
into it (the gather is the only copy on that side) and unlinks it when the transfer is released, by ack,
timeout or close. If the source process dies, multiprocessing's resource tracker unlinks what it left.
The fetcher maps the file under /dev/shm privately (copy-on-write) instead of attaching a SharedMemory, so
it holds no tracker registration that could unlink what the source owns, and copies nothing itself.
"""

import mmap
import os
import uuid
from multiprocessing.shared_memory import SharedMemory

import torch

from kvyard.disagg.layout import numel

SHM_DIR = "/dev/shm"  # where POSIX shm_open names live on Linux
PREFIX = "kvyard-kv-"


def create(size: int) -> SharedMemory:
    return SharedMemory(name=f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}", create=True, size=size)


def views(seg: SharedMemory, offsets: list[int],
          specs: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """Typed tensors over the segment at `offsets`, one per (dtype, shape) in `specs`."""
    buf = torch.frombuffer(seg.buf, dtype=torch.uint8)
    return [buf[off : off + dtype.itemsize * numel(shape)].view(dtype).view(shape)
            for off, (dtype, shape) in zip(offsets, specs, strict=True)]


def destroy(seg: SharedMemory) -> None:
    try:
        seg.unlink()
    except FileNotFoundError:
        pass
    try:
        seg.close()
    except BufferError:
        pass  # a tensor view is still alive somewhere; the name is gone, the mapping goes with the view


def read(name: str, size: int) -> torch.Tensor | None:
    """The first `size` bytes of segment `name`, mapped copy-on-write (no copy: the pages the source wrote
    are shared until someone writes them); None when there is no such segment here (another host, another
    /dev/shm namespace, or already released). Fewer bytes: a shorter tensor.

    The mapping outlives the source's unlink of the name (Linux keeps unlinked pages while they are
    mapped), so the source may release as soon as we ack; the pages go when the last tensor view does.
    """
    if "/" in name:
        return None
    try:
        with open(os.path.join(SHM_DIR, name), "rb", buffering=0) as f:
            length = min(size, os.fstat(f.fileno()).st_size)
            if length == 0:
                return torch.empty(0, dtype=torch.uint8)
            mapped = mmap.mmap(f.fileno(), length, access=mmap.ACCESS_COPY)
    except FileNotFoundError:
        return None
    return torch.frombuffer(mapped, dtype=torch.uint8)
