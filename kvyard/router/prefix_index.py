"""The global prefix index: which worker holds which cached block, fed by the workers' KV events.

Two maps kept in step: hash -> workers (to answer "who holds this block") and worker -> hashes (to drop
or replace one worker's state in one go when it resyncs or dies). What the workers hold in their offload
tiers is in `tiers` (tier_index.py).
"""

from collections.abc import Callable, Iterable, Sequence

from kvyard.router.tier_index import TierIndex


class PrefixIndex:
    def __init__(self) -> None:
        self._workers: dict[bytes, set[str]] = {}
        self._hashes: dict[str, set[bytes]] = {}
        self.tiers = TierIndex()

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
        """Forget everything about one worker (it died, restarted, or its events are in doubt)."""
        self.clear_pool(worker)
        self.tiers.drop(worker)

    def clear_pool(self, worker: str) -> None:
        """Forget the blocks in the worker's pool (not those in its tiers)."""
        self.remove(worker, list(self._hashes.get(worker, ())))
        self._hashes.pop(worker, None)

    def replace(self, worker: str, hashes: Iterable[bytes], tiers: dict[str, list[bytes]] | None = None) -> None:
        """A worker's state from its snapshot: its pool's blocks, and its own tiers'."""
        self.clear_pool(worker)
        self.add(worker, hashes)
        self.tiers.replace(worker, tiers or {})

    def holds(self, worker: str, h: bytes) -> bool:
        return worker in self._workers.get(h, ())

    def num_blocks(self, worker: str) -> int:
        return len(self._hashes.get(worker, ()))

    def hashes(self, worker: str) -> set[bytes]:
        return set(self._hashes.get(worker, ()))


def leading_overlap(
    hashes: Sequence[bytes], workers: Iterable[str], credit: Callable[[str, bytes], float]
) -> dict[str, float]:
    """For each worker, the credits of the leading `hashes` it can get without a gap (1.0 a block in its
    pool, less one it must load from a tier, 0.0 none): the blocks a request would not recompute there (the
    engine only ever reuses a prefix of a prompt's blocks, from the pool and the tiers below it)."""
    out = {}
    for w in workers:
        total = 0.0
        for h in hashes:
            c = credit(w, h)
            if c <= 0.0:
                break
            total += c
        out[w] = total
    return out
