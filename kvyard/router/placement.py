"""Placement: from a request's block hashes to a worker, and the bookkeeping of what we sent where.

Every policy sees the same candidates (live workers with their cached overlap, from the prefix index
and the predicted state), so hit accounting is comparable across policies: for each decision we count
the blocks the chosen worker holds and the most any live worker holds (the oracle's choice).
"""

from dataclasses import dataclass

from kvyard.engine.block_manager import block_hashes
from kvyard.router.policies import Candidate, Policy, RouteRequest
from kvyard.router.predicted import PredictedCache
from kvyard.router.prefix_index import PrefixIndex, leading_overlap
from kvyard.router.registry import WorkerRegistry
from kvyard.router.worker import Worker


@dataclass
class Decision:
    worker: Worker
    overlap: float  # blocks of the request the chosen worker holds (a tier's blocks at their credit)
    oracle: float  # the most any live worker holds
    reason: str


def route_request(token_ids: list[int] | None, block_size: int, salt: bytes = b"", adapter: str | None = None
                  ) -> RouteRequest:
    """The request as placement sees it; without tokens (they could not be computed) it is cache-blind."""
    if not token_ids:
        return RouteRequest([], 0, 0, adapter)
    n = len(token_ids)
    return RouteRequest(block_hashes(token_ids, block_size, salt), (n - 1) // block_size, -(-n // block_size),
                        adapter)


class Placement:
    def __init__(
        self, registry: WorkerRegistry, index: PrefixIndex, predicted: PredictedCache, policy: Policy
    ):
        self.registry = registry
        self.index = index
        self.predicted = predicted
        self.policy = policy
        self.metrics = registry.metrics

    def holds(self, worker: str, h: bytes) -> bool:
        return self.index.holds(worker, h) or self.predicted.holds(worker, h)

    def credit(self, worker: str, h: bytes) -> float:
        """1.0 for a block in the worker's pool (or predicted there), its tier's credit for one it can load."""
        return 1.0 if self.holds(worker, h) else self.index.tiers.credit(worker, h)

    def live(self, pool: str = "decode") -> list[Worker]:
        return [w for w in self.registry.routable() if w.serves(pool)]

    def overlaps(self, req: RouteRequest, workers: list[Worker]) -> dict[str, float]:
        return leading_overlap(req.hashes[: req.matchable], [w.url for w in workers], self.credit)

    def pick(
        self,
        req: RouteRequest,
        exclude: set[str] = frozenset(),  # type: ignore[assignment]
        live: list[Worker] | None = None,
        policy: Policy | None = None,
        count_hits: bool = True,
    ) -> Decision | None:
        """Choose among `live` (default: the decode pool) with `policy` (default: the router's)."""
        live = [w for w in (self.live() if live is None else live)
                if w.url not in exclude and (req.adapter is None or w.serves_adapter(req.adapter))]
        if not live:
            return None
        policy = policy or self.policy
        overlaps = self.overlaps(req, live)
        candidates = [Candidate(w, overlaps[w.url]) for w in live]
        chosen, reason = policy.choose(req, candidates)
        oracle = max(overlaps.values())
        self.metrics.decisions.labels(policy.name, reason).inc()
        if count_hits and not exclude:  # count each request once, not once per retry
            self.metrics.blocks.labels("queried").inc(req.matchable)
            self.metrics.blocks.labels("predicted_hit").inc(chosen.overlap)
            self.metrics.blocks.labels("oracle_hit").inc(oracle)
        return Decision(chosen.worker, chosen.overlap, oracle, reason)

    def begin(self, d: Decision, req: RouteRequest) -> None:
        d.worker.in_flight += 1
        d.worker.in_flight_blocks += req.num_blocks
        self.predicted.add(d.worker.url, req.hashes)

    def end(self, d: Decision, req: RouteRequest) -> None:
        d.worker.in_flight -= 1
        d.worker.in_flight_blocks -= req.num_blocks
