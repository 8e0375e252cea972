"""What the workers hold below their pools (their KV offload tiers), and the credit each tier's blocks earn.

A worker's own tiers (host memory, local disk) are indexed per worker, like the pool's blocks in
prefix_index.py. A tier shared by replicas (Redis: a medium named `redis:<id>`, kvyard/engine/kv_events.py)
is indexed once under its name: a block any replica wrote there is a block every replica that reads the same
tier can load. Its entries never hear of Redis's own evictions, so the index keeps only the most recent
`shared_limit` of them.

A block in a tier is worth less than one in the pool: the worker must load it. Each worker reports, per
tier, the share of a pool block's prefill time a block there saves (its measured load time against its
recompute time; Dynamo's fixed credits before it has measured). The router's overlap for a worker is the sum of
credits over the leading blocks of the prompt that the worker can get without recomputing: the pool's count 1.
"""

from collections import OrderedDict

from kvyard.engine.kv_events import is_shared


class TierIndex:
    def __init__(self, shared_limit: int = 1 << 20):
        self._own: dict[str, dict[str, set[bytes]]] = {}  # worker -> medium -> hashes
        self._shared: dict[str, OrderedDict[bytes, None]] = {}  # shared medium -> hashes, oldest first
        self._reads: dict[str, set[str]] = {}  # worker -> the shared media it reads
        self._credits: dict[str, dict[str, float]] = {}  # worker -> medium -> credit
        self.shared_limit = shared_limit

    def add(self, worker: str, medium: str, hashes: list[bytes]) -> None:
        if is_shared(medium):
            self._reads.setdefault(worker, set()).add(medium)
            entries = self._shared.setdefault(medium, OrderedDict())
            for h in hashes:
                entries[h] = None
                entries.move_to_end(h)
            while len(entries) > self.shared_limit:
                entries.popitem(last=False)
        else:
            self._own.setdefault(worker, {}).setdefault(medium, set()).update(hashes)

    def remove(self, worker: str, medium: str, hashes: list[bytes]) -> None:
        if is_shared(medium):  # a replica found it gone: gone for all of them
            entries = self._shared.get(medium, OrderedDict())
            for h in hashes:
                entries.pop(h, None)
        else:
            self._own.get(worker, {}).get(medium, set()).difference_update(hashes)

    def replace(self, worker: str, tiers: dict[str, list[bytes]]) -> None:
        """A worker's own tiers from its snapshot (what it knows of the shared ones stays)."""
        self._own[worker] = {m: set(hs) for m, hs in tiers.items() if not is_shared(m)}

    def drop(self, worker: str) -> None:
        """Forget the worker (its shared tiers' blocks stay: other replicas read them)."""
        self._own.pop(worker, None)
        self._reads.pop(worker, None)
        self._credits.pop(worker, None)

    def set_credits(self, worker: str, credits: dict[str, float]) -> None:
        self._credits[worker] = credits
        for medium in credits:
            if is_shared(medium):  # it reads this tier even before it wrote to it
                self._reads.setdefault(worker, set()).add(medium)

    def credit(self, worker: str, h: bytes) -> float:
        """The best credit among the worker's tiers holding this block (0.0: none does)."""
        credits = self._credits.get(worker, {})
        best = 0.0
        for medium, hashes in self._own.get(worker, {}).items():
            if h in hashes:
                best = max(best, credits.get(medium, 0.0))
        for medium in self._reads.get(worker, ()):
            if h in self._shared.get(medium, ()):
                best = max(best, credits.get(medium, 0.0))
        return best

    def credits(self, worker: str) -> dict[str, float]:
        return dict(self._credits.get(worker, {}))

    def num_blocks(self, worker: str) -> dict[str, int]:
        """Per medium, the blocks the worker can load (its own tiers, and the shared ones it reads)."""
        out = {m: len(hs) for m, hs in self._own.get(worker, {}).items()}
        out.update({m: len(self._shared.get(m, ())) for m in self._reads.get(worker, ())})
        return out
