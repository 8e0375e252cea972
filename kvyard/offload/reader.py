"""Reads blocks from the tiers of bytes (disk, Redis) on threads of their own, so the engine keeps stepping the
running requests while a waiting request's prefix comes back (vLLM's "waiting for remote KVs", SGLang HiCache's
prefetch). A few threads: a remote tier's reads wait mostly on the network, and the rest (file reads, the checksum)
releases the GIL, so a prompt's blocks are read side by side.

A block two waiting requests share is read once: the second request gets the first one's future.
"""

import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvyard.offload.host_tier import TierBlock

READ_THREADS = 4

Read = Callable[[bytes, tuple[int, ...]], TierBlock | None]


@dataclass
class ReadResult:
    entry: TierBlock | None  # None: missing or damaged (the tier counted it)
    seconds: float  # what reading and checking it took on the reader thread


class BlockReader:
    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="kv-read")
        self._lock = threading.Lock()
        self._reading: dict[tuple[str, bytes], concurrent.futures.Future[ReadResult]] = {}

    def read(self, tier: str, get: Read, h: bytes, tokens: tuple[int, ...]) -> "concurrent.futures.Future[ReadResult]":
        with self._lock:
            future = self._reading.get((tier, h))
            if future is None:
                future = self._pool.submit(self._timed, tier, get, h, tokens)
                self._reading[(tier, h)] = future
            return future

    def _timed(self, tier: str, get: Read, h: bytes, tokens: tuple[int, ...]) -> ReadResult:
        started = time.perf_counter()
        try:
            entry = get(h, tokens)
        finally:
            with self._lock:  # done: a later request reads it again (or finds it in the pool by then)
                self._reading.pop((tier, h), None)
        return ReadResult(entry, time.perf_counter() - started)

    def wait(self, timeout: float) -> None:
        """Until a read finishes, or `timeout` seconds (the engine has nothing else to do)."""
        with self._lock:
            futures = list(self._reading.values())
        if futures:
            concurrent.futures.wait(futures, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
