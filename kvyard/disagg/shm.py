"""Shared-memory segments for a transfer between two processes on one host.

The source owns each segment (`shm_pool.SegmentPool` reuses them across transfers): it gathers the blocks
straight into one (the gather is the only copy on that side) and gets it back when the transfer is
released, by ack, timeout or close. If the source process dies, multiprocessing's resource tracker
unlinks what it left. The fetcher maps the file under /dev/shm shared and read-only instead of attaching
a SharedMemory, so it holds no tracker registration that could unlink what the source owns, and is done
reading it (copied out, or used in place by the decode engine) before it acks: after the ack the source
may rewrite the segment for another transfer.
"""

import mmap
import os
import uuid
from multiprocessing.shared_memory import SharedMemory

import numpy as np

SHM_DIR = "/dev/shm"  # where POSIX shm_open names live on Linux
PREFIX = "kvyard-kv-"


def create(size: int) -> SharedMemory:
    """A new segment whose pages are reserved: OSError (ENOSPC) here rather than SIGBUS on a later write
    when /dev/shm is full."""
    seg = SharedMemory(name=f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}", create=True, size=size)
    try:
        fd = os.open(os.path.join(SHM_DIR, seg.name), os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
    except OSError:
        destroy(seg)
        raise
    return seg


def destroy(seg: SharedMemory) -> None:
    try:
        seg.unlink()
    except FileNotFoundError:
        pass
    try:
        seg.close()
    except BufferError:
        pass  # a tensor view is still alive somewhere; the name is gone, the mapping goes with the view


def read(name: str, size: int) -> np.ndarray | None:
    """The first `size` bytes of segment `name`, mapped shared and read-only (no copy); None when there is
    no such segment here (another host, another /dev/shm namespace, or already released). Fewer bytes: a
    shorter array.

    MAP_POPULATE maps every page in the one mmap call instead of one fault per 4 KiB page on first read.
    The caller must be done reading (a copy, or the engine's scatter) before it acks (the source reuses
    the segment after that) and
    should drop the array then; the mapping goes with the last view of it.
    """
    if "/" in name:
        return None
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        length = min(size, os.fstat(fd).st_size)
        if length == 0:
            return np.empty(0, dtype=np.uint8)
        mapped = mmap.mmap(fd, length, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return np.frombuffer(mapped, dtype=np.uint8)
