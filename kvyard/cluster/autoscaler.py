"""Autoscaling the colocated replicas of a Ray deployment on signals that fit LLM serving.

A replica is overloaded when requests queue in its engine, when its KV cache fills up (the next requests
will wait or preempt), or when the router's time to first token exceeds a target. Request rates are not a
signal: a request's cost varies a hundredfold with its prompt and output, and users of rate-based
autoscalers report them oscillating or stuck. So:

* up: any overload signal (mean queued requests per replica above `target_waiting`, mean KV usage above
  `max_kv_usage`, TTFT p50 over the last look above `ttft_target_s`) held for `up_after_s`;
* down: nothing queued and the requests in flight would fit on one replica fewer at `down_load` each, held
  for `down_after_s`. The replica with the fewest requests in flight is drained first: the router stops
  sending it requests, those in flight finish (up to `drain_timeout_s`), then its actor is removed;
* after any change, nothing for `cooldown_s`; never outside [min_replicas, max_replicas].

`ScalePolicy` is the decision alone (pure: signals and a clock in, a decision out); `Autoscaler` runs it on
the router's event loop and acts through the controller. Every decision is counted in the router's metrics.
"""

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter, Gauge

from kvyard.cluster.config import AutoscaleConfig
from kvyard.router.worker import Worker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Signals:
    replicas: int  # colocated replicas serving (not draining)
    waiting: float  # mean requests queued in each replica's engine
    kv_usage: float  # mean fraction of each replica's KV cache in use
    in_flight: int  # requests the router has in flight on them
    ttft_p50_s: float | None = None  # the router's TTFT p50 since the last look (None: no stream started)

    @classmethod
    def of(cls, workers: list[Worker], ttft_p50_s: float | None) -> "Signals":
        n = len(workers)
        return cls(n, sum(w.waiting for w in workers) / n if n else 0.0,
                   sum(w.kv_usage for w in workers) / n if n else 0.0, sum(w.in_flight for w in workers),
                   ttft_p50_s)


@dataclass(frozen=True)
class Decision:
    delta: int  # +1 add a replica, -1 remove one, 0 hold
    reason: str


@dataclass
class ScalePolicy:
    config: AutoscaleConfig
    down_load: float = 1.0  # requests in flight per remaining replica that still count as light load
    overloaded_since: float | None = None
    light_since: float | None = None
    last_change: float = float("-inf")

    def overloads(self, s: Signals) -> list[str]:
        c = self.config
        found = []
        if s.waiting > c.target_waiting:
            found.append("queue")
        if s.kv_usage > c.max_kv_usage:
            found.append("kv_cache")
        if c.ttft_target_s is not None and s.ttft_p50_s is not None and s.ttft_p50_s > c.ttft_target_s:
            found.append("ttft")
        return found

    def decide(self, s: Signals, now: float) -> Decision:
        c = self.config
        overloads = self.overloads(s)
        light = not overloads and s.waiting == 0 and s.in_flight <= self.down_load * (s.replicas - 1)
        self.overloaded_since = _since(self.overloaded_since, now) if overloads else None
        self.light_since = _since(self.light_since, now) if light else None
        if s.replicas < c.min_replicas:
            return Decision(+1, "below_min")
        if s.replicas > c.max_replicas:
            return Decision(-1, "above_max")
        if now - self.last_change < c.cooldown_s:
            return Decision(0, "cooldown")
        if self.overloaded_since is not None and now - self.overloaded_since >= c.up_after_s:
            if s.replicas < c.max_replicas:
                return Decision(+1, overloads[0])
            return Decision(0, "at_max")
        if self.light_since is not None and now - self.light_since >= c.down_after_s and s.replicas > c.min_replicas:
            return Decision(-1, "light_load")
        return Decision(0, "steady")

    def changed(self, now: float) -> None:
        """A change took effect at `now`: the cooldown starts, and the signals must build up again."""
        self.last_change = now
        self.overloaded_since = self.light_since = None


def _since(start: float | None, now: float) -> float:
    return now if start is None else start


@dataclass
class Autoscaler:
    policy: ScalePolicy
    controller: Any  # kvyard/cluster/controller.py's RayController
    registry: Any  # the router's WorkerRegistry
    observed: Any  # the router's Observed (TTFT of relayed streams)
    history: list[tuple[float, int, str]] = field(default_factory=list)  # (unix time, replicas, reason)

    def __post_init__(self) -> None:
        r = self.registry.metrics.registry
        self.decisions = Counter("kvyard_router_autoscale_decisions", "Autoscaling changes by direction, "
                                 "reason and outcome", ["direction", "reason", "outcome"], registry=r)
        self.replicas = Gauge("kvyard_router_autoscale_replicas", "Colocated replicas serving", registry=r)
        self.signals = Gauge("kvyard_router_autoscale_signal", "What the autoscaler last saw: mean queued "
                             "requests, mean KV usage, TTFT p50 (s)", ["signal"], registry=r)

    def serving(self) -> list[Worker]:
        urls = {rep.url for rep in self.controller.replicas if rep.role == "both"}
        return [w for w in self.registry.routable() if w.url in urls]

    async def run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.policy.config.interval_s)
            now = time.monotonic()
            s = Signals.of(self.serving(), self.observed.ttft_quantile_since(last))
            last = now
            self._show(s)
            d = self.policy.decide(s, now)
            if d.delta:
                await self._act(d, s)

    def _show(self, s: Signals) -> None:
        self.replicas.set(s.replicas)
        self.signals.labels("waiting").set(s.waiting)
        self.signals.labels("kv_usage").set(s.kv_usage)
        self.signals.labels("ttft_p50_s").set(s.ttft_p50_s if s.ttft_p50_s is not None else float("nan"))
        if not self.history or self.history[-1][1] != s.replicas:
            self.history.append((time.time(), s.replicas, "observed"))

    async def _act(self, d: Decision, s: Signals) -> None:
        direction = "up" if d.delta > 0 else "down"
        log.info("autoscaling %s from %d replicas: %s (queued %.2f, KV %.2f, in flight %d, TTFT p50 %s)",
                 direction, s.replicas, d.reason, s.waiting, s.kv_usage, s.in_flight, s.ttft_p50_s)
        try:
            if d.delta > 0:
                await self.controller.add_replica(self.registry)
            else:
                await self._drain_and_remove()
            outcome = "done"
        except Exception as e:  # noqa: BLE001 - a failed placement is logged; the deployment keeps serving
            log.error("autoscaling %s failed: %s", direction, e)
            outcome = "failed"
        self.decisions.labels(direction, d.reason, outcome).inc()
        self.policy.changed(time.monotonic())
        self.history.append((time.time(), len(self.serving()), f"{direction}:{d.reason}:{outcome}"))

    async def _drain_and_remove(self) -> None:
        candidates = self.serving()
        if len(candidates) <= 1:
            return
        w = min(candidates, key=lambda x: (x.in_flight, x.url))
        w.draining = True  # the router sends it nothing new from here on
        deadline = time.monotonic() + self.policy.config.drain_timeout_s
        while w.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if w.in_flight:
            log.warning("replica %s still had %d requests after the drain timeout", w.url, w.in_flight)
        await self.controller.retire(self.registry, w.url)
