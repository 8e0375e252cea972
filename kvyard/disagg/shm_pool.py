"""A source's pool of shared-memory segments, reused across transfers.

A fresh segment costs more than the transfer itself: every page of it is allocated, zeroed and faulted in
on first write (136 ms for 46 MB on the shared 2-core VM, against 5 ms to rewrite a segment already
mapped). So the source takes a segment from this pool for each shared-memory reply and gives it back when
the transfer is released (ack, reject, timeout, close): by then the decode side has read everything
(it reads before it acks, and the source holds the transfer for the fetcher's lease otherwise), so a
segment is never rewritten while someone may still read it.

Segments grow on demand: `acquire` takes the smallest free segment that fits, else creates one rounded up
to `GRANULE`. Idle segments beyond `max_idle_bytes` are unlinked on release; all of them are unlinked on
`close` and at interpreter exit. If the process dies, multiprocessing's resource tracker unlinks them.
A prefill worker `warm`s one segment at start, sized for its longest prompt, so that no transfer pays the
first-write cost.
"""

import threading
import weakref
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from kvyard.disagg import shm

GRANULE = 2 << 20  # sizes round up to this, so transfers of similar length share a segment
MAX_IDLE_BYTES = 256 << 20  # default: idle segments kept for reuse, at most this much /dev/shm


class SegmentPool:
    def __init__(self, max_idle_bytes: int = MAX_IDLE_BYTES):
        self.max_idle_bytes = max_idle_bytes
        self.created = 0  # segments ever created: a test and the benchmark see reuse here
        self._free: list[SharedMemory] = []
        self._lock = threading.Lock()
        # Unlinks what is idle when the pool is closed, collected or the interpreter exits.
        self._finalizer = weakref.finalize(self, _destroy_all, self._free)

    def acquire(self, size: int) -> SharedMemory:
        """A segment of at least `size` bytes that nobody else uses until `release`; OSError if none fits."""
        with self._lock:
            fits = [s for s in self._free if s.size >= size]
            if fits:
                seg = min(fits, key=lambda s: s.size)
                self._free.remove(seg)
                return seg
        seg = shm.create(-(-size // GRANULE) * GRANULE)
        self.created += 1
        return seg

    def release(self, seg: SharedMemory) -> None:
        """Give `seg` back: nothing may read or write it any more except through a later `acquire`."""
        with self._lock:
            if self._finalizer.alive and self.idle_bytes + seg.size <= self.max_idle_bytes:
                self._free.append(seg)
                return
        shm.destroy(seg)

    def warm(self, size: int) -> bool:
        """Create one segment of `size` bytes and fault every page in now, so the first transfer does not
        pay for it; False (nothing kept) when /dev/shm cannot hold it or the pool would not keep it."""
        if -(-size // GRANULE) * GRANULE > self.max_idle_bytes:
            return False
        try:
            seg = self.acquire(size)
        except OSError:
            return False
        pages = np.frombuffer(seg.buf, dtype=np.uint8)
        pages.fill(0)
        del pages  # no view may outlive this: close() unmaps the segment
        self.release(seg)
        return True

    @property
    def idle_bytes(self) -> int:
        return sum(s.size for s in self._free)

    @property
    def num_idle(self) -> int:
        return len(self._free)

    def close(self) -> None:
        """Unlink every idle segment; segments released later are unlinked at once."""
        with self._lock:
            self._finalizer()


def _destroy_all(segments: list[SharedMemory]) -> None:
    while segments:
        shm.destroy(segments.pop())
