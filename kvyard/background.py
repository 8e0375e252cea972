"""One background thread working through a bounded queue: for work that must never hold up its caller (KV
writes to a slow tier, traffic capture). `submit` never blocks: with the queue full it returns False and the
caller counts the item as dropped.

With `work_many`, the thread takes every item already queued (up to `max_batch`) in one call, so that a remote
store pays one round trip for a batch instead of one per item; it never waits for a batch to fill."""

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class BoundedWorker(Generic[T]):
    def __init__(self, work: Callable[[T], None], name: str, max_pending: int,
                 on_error: Callable[[Exception], None], after: Callable[[T], None] | None = None,
                 work_many: Callable[[list[T]], None] | None = None, max_batch: int = 64):
        """`work(item)` on the thread, or `work_many(items)` where given; `on_error(e)` when it raises;
        `after(item)` once each item is done either way."""
        self.on_error, self.after = on_error, after
        # Without work_many every batch is one item
        self._run: Callable[[list[T]], None] = work_many or (lambda items: work(items[0]))
        self.max_batch = max_batch if work_many is not None else 1
        self._queue: queue.Queue[tuple[T] | None] = queue.Queue(max_pending)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: T) -> bool:
        try:
            self._queue.put_nowait((item,))
        except queue.Full:
            return False
        return True

    def flush(self) -> None:
        """Wait until every submitted item is done."""
        self._queue.join()

    def close(self, timeout: float = 10.0) -> None:
        """Finish what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        stopping = False
        while not stopping:
            items, stopping = self._take()
            if not items:
                continue
            try:
                self._run(items)
            except Exception as e:  # noqa: BLE001 - the caller's on_error decides; the thread goes on
                self.on_error(e)
            finally:
                for item in items:
                    if self.after is not None:
                        self.after(item)
                    self._queue.task_done()
        self._queue.task_done()

    def _take(self) -> tuple[list[T], bool]:
        """The next item, waiting for it, then those already queued (up to max_batch); and whether to stop."""
        boxed = self._queue.get()
        if boxed is None:
            return [], True
        items = [boxed[0]]
        while len(items) < self.max_batch:
            try:
                boxed = self._queue.get_nowait()
            except queue.Empty:
                break
            if boxed is None:
                return items, True
            items.append(boxed[0])
        return items, False
