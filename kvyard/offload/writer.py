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
    def __init__(self, write: Callable[[bytes, tuple[int, ...], torch.Tensor], None], name: str,
                 max_pending: int, on_error: Callable[[Exception], None],
                 write_many: Callable[[list[Write]], None] | None = None):
        """`write(h, tokens, block)` per block, or `write_many(writes)` for every write queued at once (a remote
        tier's one round trip)."""
        self.write, self.write_many = write, write_many
        self.lock = threading.Lock()
        self.pending: dict[bytes, Write] = {}  # by hash, the writes queued or under way
        self.dropped = 0
        self.cpu_s = 0.0  # the writer thread's CPU time in writes: what they take from the forward pass
        self._worker: BoundedWorker[Write] = BoundedWorker(
            self._timed_write, f"kvyard-kv-{name}", max_pending, on_error, after=self._written,
            work_many=self._timed_write_many if write_many is not None else None)

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

    def _timed_write(self, w: Write) -> None:
        self._timed(self.write, *w)

    def _timed_write_many(self, writes: list[Write]) -> None:
        assert self.write_many is not None
        self._timed(self.write_many, writes)

    def _timed(self, fn: Callable[..., None], *args: object) -> None:
        started = time.thread_time()
        try:
            fn(*args)
        finally:
            self.cpu_s += time.thread_time() - started

    def _written(self, w: Write) -> None:
        with self.lock:
            self.pending.pop(w[0], None)
