"""One background thread working through a bounded queue: for work that must never hold up its caller (KV
writes to a slow tier, traffic capture). `submit` never blocks: with the queue full it returns False and the
caller counts the item as dropped."""

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class BoundedWorker(Generic[T]):
    def __init__(self, work: Callable[[T], None], name: str, max_pending: int,
                 on_error: Callable[[Exception], None], after: Callable[[T], None] | None = None):
        """`work(item)` on the thread; `on_error(e)` when it raises; `after(item)` once it is done either way."""
        self.work, self.on_error, self.after = work, on_error, after
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
        while (boxed := self._queue.get()) is not None:
            try:
                self.work(boxed[0])
            except Exception as e:  # noqa: BLE001 - the caller's on_error decides; the thread goes on
                self.on_error(e)
            finally:
                if self.after is not None:
                    self.after(boxed[0])
                self._queue.task_done()
        self._queue.task_done()
