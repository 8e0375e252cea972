"""Routing policies behind one interface: given the candidates (live workers, each with the number of the
request's blocks it holds), pick one.

* `round-robin`, `random`: ignore everything; the baselines.
* `least-loaded`: fewest requests in flight from this router (ties: the worker's own queue, then turns).
* `kv`: Dynamo's cost, `prefill_weight * uncached blocks + load_weight * blocks in flight`, lowest wins
  (or a softmax over normalised costs with `temperature` > 0). Hot-spot protection first removes workers
  above `hot_spot_factor * mean + hot_spot_slack` requests in flight, so a popular prefix can never pull
  every request onto one replica while others idle; the prefix then gets cached on a second worker too.
"""

import itertools
import math
import random
from dataclasses import dataclass
from typing import Protocol

from kvyard.router.config import RouterSettings
from kvyard.router.worker import Worker


@dataclass
class Candidate:
    worker: Worker
    overlap: float  # leading blocks of the request this worker holds (index + predicted; a tier's at its credit)


@dataclass
class RouteRequest:
    hashes: list[bytes]  # every full block of the prompt: what the worker will cache
    matchable: int  # how many of them a worker can reuse (the engine always recomputes the last token)
    num_blocks: int  # the prompt's size in blocks, full or not: its load while in flight
    adapter: str | None = None  # the LoRA adapter it names: only workers serving it may take it


class Policy(Protocol):
    name: str

    def choose(self, req: RouteRequest, candidates: list[Candidate]) -> tuple[Candidate, str]:
        """The chosen candidate and why (a short label for the decisions metric)."""
        ...


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, req: RouteRequest, candidates: list[Candidate]) -> tuple[Candidate, str]:
        ordered = sorted(candidates, key=lambda c: c.worker.url)
        return ordered[next(self._turn) % len(ordered)], "turn"


class RandomPolicy:
    name = "random"

    def __init__(self, rng: random.Random):
        self._rng = rng

    def choose(self, req: RouteRequest, candidates: list[Candidate]) -> tuple[Candidate, str]:
        return self._rng.choice(candidates), "random"


class LeastLoaded:
    name = "least-loaded"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, req: RouteRequest, candidates: list[Candidate]) -> tuple[Candidate, str]:
        turn = next(self._turn)
        n = len(candidates)
        ordered = sorted(candidates, key=lambda c: c.worker.url)
        # The rotating index breaks ties, so equal workers take turns instead of the first always winning.
        best = min(
            range(n), key=lambda i: (ordered[i].worker.in_flight, ordered[i].worker.waiting, (i - turn) % n)
        )
        return ordered[best], "load"


def hot_spot_filter(candidates: list[Candidate], factor: float, slack: float) -> list[Candidate]:
    """The candidates that may take one more request without rising above factor * mean + slack in flight."""
    total = sum(c.worker.in_flight for c in candidates) + 1
    limit = factor * total / len(candidates) + slack
    allowed = [c for c in candidates if c.worker.in_flight + 1 <= limit]
    return allowed or [min(candidates, key=lambda c: c.worker.in_flight)]


class KVPolicy:
    name = "kv"

    def __init__(self, settings: RouterSettings, rng: random.Random):
        self.s = settings
        self._rng = rng

    def cost(self, req: RouteRequest, c: Candidate) -> float:
        uncached = req.num_blocks - c.overlap
        return self.s.prefill_weight * uncached + self.s.load_weight * c.worker.in_flight_blocks

    def choose(self, req: RouteRequest, candidates: list[Candidate]) -> tuple[Candidate, str]:
        allowed = hot_spot_filter(candidates, self.s.hot_spot_factor, self.s.hot_spot_slack)
        costs = [self.cost(req, c) for c in allowed]
        if self.s.temperature > 0:
            pick = allowed[self._softmax_index(costs)]
        else:
            low = min(costs)
            ties = [c for c, cost in zip(allowed, costs, strict=True) if cost == low]
            fewest = min(c.worker.in_flight for c in ties)
            pick = self._rng.choice([c for c in ties if c.worker.in_flight == fewest])
        best_overlap = max(c.overlap for c in candidates)
        if len(allowed) < len(candidates) and pick.overlap < best_overlap:
            return pick, "hot_spot"
        return pick, "affinity" if pick.overlap > 0 else "load"

    def _softmax_index(self, costs: list[float]) -> int:
        low, high = min(costs), max(costs)
        span = max(high - low, 1e-9)
        weights = [math.exp(-(c - low) / span / self.s.temperature) for c in costs]
        return self._rng.choices(range(len(costs)), weights=weights)[0]


def make_policy(settings: RouterSettings) -> Policy:
    rng = random.Random(settings.seed)
    if settings.policy == "kv":
        return KVPolicy(settings, rng)
    if settings.policy == "round-robin":
        return RoundRobin()
    if settings.policy == "least-loaded":
        return LeastLoaded()
    return RandomPolicy(rng)
