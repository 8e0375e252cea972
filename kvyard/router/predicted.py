"""Predicted cache state: blocks a worker is about to cache because we just sent it a request.

Events arrive only after the worker has prefilled the prompt, so without a prediction a burst of requests
sharing a new prefix would scatter over every worker (none holds it yet). After an assignment the
request's blocks count as cached on that worker for `ttl` seconds, or until the index confirms them.
"""

import time
from collections.abc import Callable, Iterable


class PredictedCache:
    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic):
        self.ttl = ttl
        self._clock = clock
        self._expiry: dict[str, dict[bytes, float]] = {}

    def add(self, worker: str, hashes: Iterable[bytes]) -> None:
        if self.ttl <= 0:
            return
        until = self._clock() + self.ttl
        mine = self._expiry.setdefault(worker, {})
        for h in hashes:
            mine[h] = until
        if len(mine) > 4096:  # expire lazily, but never let a busy worker's map grow without bound
            self._prune(worker)

    def holds(self, worker: str, h: bytes) -> bool:
        until = self._expiry.get(worker, {}).get(h)
        return until is not None and until > self._clock()

    def drop(self, worker: str) -> None:
        self._expiry.pop(worker, None)

    def size(self, worker: str) -> int:
        self._prune(worker)
        return len(self._expiry.get(worker, {}))

    def _prune(self, worker: str) -> None:
        now = self._clock()
        mine = self._expiry.get(worker, {})
        for h in [h for h, until in mine.items() if until <= now]:
            del mine[h]
