"""The global prefix index: which worker holds which cached block, fed by the workers' KV events.

Two maps kept in step: hash -> workers (to answer "who holds this block") and worker -> hashes (to drop
or replace one worker's state in one go when it resyncs or dies).
"""

from collections.abc import Callable, Iterable, Sequence


class PrefixIndex:
    def __init__(self) -> None:
        self._workers: dict[bytes, set[str]] = {}
        self._hashes: dict[str, set[bytes]] = {}

    def add(self, worker: str, hashes: Iterable[bytes]) -> None:
        mine = self._hashes.setdefault(worker, set())
        for h in hashes:
            mine.add(h)
            self._workers.setdefault(h, set()).add(worker)

    def remove(self, worker: str, hashes: Iterable[bytes]) -> None:
        mine = self._hashes.get(worker)
        if mine is None:
            return
        for h in hashes:
            mine.discard(h)
            holders = self._workers.get(h)
            if holders is not None:
                holders.discard(worker)
                if not holders:
                    del self._workers[h]

    def drop(self, worker: str) -> None:
        """Forget everything about one worker (it died, restarted, or is about to be resynced)."""
        self.remove(worker, list(self._hashes.get(worker, ())))
        self._hashes.pop(worker, None)

    def replace(self, worker: str, hashes: Iterable[bytes]) -> None:
        self.drop(worker)
        self.add(worker, hashes)

    def holds(self, worker: str, h: bytes) -> bool:
        return worker in self._workers.get(h, ())

    def num_blocks(self, worker: str) -> int:
        return len(self._hashes.get(worker, ()))

    def hashes(self, worker: str) -> set[bytes]:
        return set(self._hashes.get(worker, ()))


def leading_overlap(
    hashes: Sequence[bytes], workers: Iterable[str], holds: Callable[[str, bytes], bool]
) -> dict[str, int]:
    """For each worker, how many of the leading `hashes` it holds without a gap: the blocks a request
    would hit there (the engine only ever reuses a prefix of a prompt's blocks)."""
    out = {}
    for w in workers:
        n = 0
        while n < len(hashes) and holds(w, hashes[n]):
            n += 1
        out[w] = n
    return out
