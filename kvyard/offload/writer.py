"""Writes of KV blocks to a slow tier, off the engine's thread: one writer thread behind a bounded queue.

The engine never waits on a write: when the queue is full the block is dropped (and counted), and it stays in
the faster tiers or is recomputed later. `pending` lets a tier answer "is it there?" for blocks still queued.
"""

import logging
import queue
import threading
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

Write = tuple[bytes, tuple[int, ...], list[list[torch.Tensor]]]


class QueuedWriter:
    def __init__(self, write: Callable[[bytes, tuple[int, ...], list[list[torch.Tensor]]], None], name: str,
                 max_pending: int, on_error: Callable[[Exception], None]):
        self.write = write
        self.on_error = on_error
        self.lock = threading.Lock()
        self.pending: set[bytes] = set()
        self.dropped = 0
        self._queue: queue.Queue[Write | None] = queue.Queue(max_pending)
        self._thread = threading.Thread(target=self._loop, name=f"kvyard-kv-{name}", daemon=True)
        self._thread.start()

    def submit(self, h: bytes, tokens: tuple[int, ...], tensors: list[list[torch.Tensor]]) -> bool:
        """Queue a block (tensors the caller no longer writes); False when the queue is full (dropped)."""
        with self.lock:
            if h in self.pending:
                return True
            self.pending.add(h)
        try:
            self._queue.put_nowait((h, tokens, tensors))
        except queue.Full:
            with self.lock:
                self.pending.discard(h)
            self.dropped += 1
            return False
        return True

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            h, tokens, tensors = item
            try:
                self.write(h, tokens, tensors)
            except Exception as e:  # a full disk, a lost connection: the block just stays out of this tier
                self.on_error(e)
            finally:
                with self.lock:
                    self.pending.discard(h)
                self._queue.task_done()
        self._queue.task_done()
