"""Writes of KV blocks to a slow tier, off the engine's thread: one writer thread behind a bounded queue.

The engine never waits on a write: when the queue is full the block is dropped (and counted), and it stays in
the faster tiers or is recomputed later. `pending` lets a tier answer "is it there?" for blocks still queued,
and `queued` lets it serve them before they are written.
"""

import threading
import time
from collections.abc import Callable

import torch

from kvyard.background import BoundedWorker

Write = tuple[bytes, tuple[int, ...], torch.Tensor]  # hash, tokens, the block as one row of bytes (disagg.blocks.pack_blocks)


class QueuedWriter:
    def __init__(self, write: Callable[[bytes, tuple[int, ...], torch.Tensor], None] | None, name: str,
                 max_pending: int, on_error: Callable[[Exception], None],
                 write_many: Callable[[list[Write]], None] | None = None):
        """`write(h, tokens, block)` per block, or else `write_many(writes)` for every write queued at once (a
        remote tier's one round trip)."""
        assert (write is None) != (write_many is None), "one of write and write_many"
        self.write, self.write_many = write, write_many  # looked up at each write (a test slows one down)
        self.lock = threading.Lock()
        self.pending: dict[bytes, Write] = {}  # by hash, the writes queued or under way
        self.dropped = 0
        self.cpu_s = 0.0  # the writer thread's CPU time in writes: what they take from the forward pass
        self._worker: BoundedWorker[Write] = BoundedWorker(
            lambda w: self._timed(self.write, *w), f"kvyard-kv-{name}", max_pending, on_error, after=self._written,
            work_many=None if write_many is None else lambda ws: self._timed(self.write_many, ws))

    def submit(self, h: bytes, tokens: tuple[int, ...], block: torch.Tensor) -> bool:
        """Queue a block (bytes the caller no longer writes); False when the queue is full (dropped)."""
        with self.lock:
            if h in self.pending:
                return True
            self.pending[h] = (h, tokens, block)
        if not self._worker.submit((h, tokens, block)):
            self._written((h, tokens, block))
            self.dropped += 1
            return False
        return True

    def queued(self, h: bytes) -> Write | None:
        """The write of this block, while it is queued or under way."""
        with self.lock:
            return self.pending.get(h)

    def flush(self) -> None:
        self._worker.flush()

    def close(self) -> None:
        self._worker.close()

    def _timed(self, fn: Callable[..., None], *args: object) -> None:
        started = time.thread_time()
        try:
            fn(*args)
        finally:
            self.cpu_s += time.thread_time() - started

    def _written(self, w: Write) -> None:
        with self.lock:
            self.pending.pop(w[0], None)
