"""Memory whose pages are already mapped, reused once nothing refers to it any more.

Writing 46 MB into fresh memory costs a page fault per 4 KiB on this VM (10-25 ms, against 4-6 ms for the
same copy into pages already mapped), and malloc hands large freed blocks back to the kernel. So both
ends of a transfer stage their bytes in buffers kept here: the source gathers a TCP reply into one, the
fetcher copies what it receives (from ZeroMQ frames or a shared-memory segment) into one.

A buffer may be reused only when nothing can still read it. Tensors are made with `torch.from_numpy` over
slices of a buffer; every such tensor, every torch view of one, and every ZeroMQ frame still queued for
sending from one keeps the buffer's numpy array referenced. So a buffer whose reference count is back to
what this module itself holds is unused, whatever the engine or ZeroMQ did with it in between.
"""

import sys
import threading

import numpy as np

GRANULE = 2 << 20  # sizes round up to this, so transfers of similar length share a buffer
MAX_BYTES = 256 << 20  # default: at most this much kept per pool; beyond it, buffers are not kept
_IDLE_REFS = 3  # references while unused: self._buffers, the loop variable, getrefcount's argument


class WarmBuffers:
    def __init__(self, max_bytes: int = MAX_BYTES):
        self.max_bytes = max_bytes
        self.allocated = 0  # buffers ever allocated: a test sees reuse here
        self._buffers: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> np.ndarray:
        """`size` writable bytes that no live tensor uses. Slices of it keep it from being taken again."""
        with self._lock:
            free = [buf for buf in self._buffers if sys.getrefcount(buf) == _IDLE_REFS]
            fits = [buf for buf in free if buf.size >= size]
            if fits:
                return min(fits, key=lambda b: b.size)[:size]
            for buf in free:  # too small for this transfer: make room for one that fits
                self._buffers.remove(buf)
            new = np.empty(-(-size // GRANULE) * GRANULE, dtype=np.uint8)
            self.allocated += 1
            if sum(b.size for b in self._buffers) + new.size <= self.max_bytes:
                self._buffers.append(new)
            return new[:size]

    @property
    def num_kept(self) -> int:
        return len(self._buffers)
