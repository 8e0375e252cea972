"""The router's Prometheus metrics, in a registry of its own.

Hit accounting, in blocks: `queried` counts every request's reusable blocks, `predicted_hit` the ones the
chosen worker holds by the router's view (index + predictions), `oracle_hit` the most any live worker
holds. predicted_hit / oracle_hit is how close a policy comes to always picking the best match. Each
worker's own hit rate (`observed`, from its /metrics) says what the engines actually reused.
"""

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kvyard.router.worker import Worker, WorkerStatus


class _WorkerCollector(Collector):
    def __init__(self, workers: Callable[[], Iterable[Worker]]):
        self._workers = workers

    def collect(self) -> Iterator[Metric]:
        workers = list(self._workers())
        gauges = {
            "healthy": (
                "kvyard_router_worker_healthy",
                "1 while the worker is routed to",
                lambda w: float(w.status is WorkerStatus.HEALTHY),
            ),
            "in_flight": (
                "kvyard_router_worker_in_flight",
                "Requests this router has in flight on the worker",
                lambda w: w.in_flight,
            ),
            "queue": (
                "kvyard_router_worker_queue_depth",
                "Running + waiting requests the worker reports",
                lambda w: w.running + w.waiting,
            ),
            "hit_rate": (
                "kvyard_router_worker_observed_hit_rate",
                "The worker's own prefix-cache hit rate (tokens)",
                lambda w: w.observed_hit_rate,
            ),
        }
        for name, doc, value in gauges.values():
            family = GaugeMetricFamily(name, doc, labels=["worker"])
            for w in workers:
                family.add_metric([w.url], value(w))
            yield family


class RouterMetrics:
    def __init__(self, workers: Callable[[], Iterable[Worker]]):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "kvyard_router_requests",
            "Requests proxied, by worker and outcome",
            ["worker", "outcome"],
            registry=r,
        )
        self.decisions = Counter(
            "kvyard_router_decisions",
            "Routing decisions by policy and reason",
            ["policy", "reason"],
            registry=r,
        )
        self.blocks = Counter(
            "kvyard_router_prefix_blocks",
            "Reusable prompt blocks: queried, predicted_hit (chosen worker), oracle_hit (best worker)",
            ["kind"],
            registry=r,
        )
        self.retries = Counter(
            "kvyard_router_retries",
            "Requests sent again to another worker, by reason",
            ["reason"],
            registry=r,
        )
        self.resyncs = Counter(
            "kvyard_router_kv_resyncs",
            "Prefix-index resyncs from a worker snapshot",
            ["worker", "reason"],
            registry=r,
        )
        self.disagg = Counter(
            "kvyard_router_disagg_decisions",
            "Where each prompt was prefilled: remote (a prefill worker), or local and why (short: few uncached "
            "tokens, saturated: every prefill worker busy, prefill_failed: the prefill worker failed)",
            ["decision"],
            registry=r,
        )
        self.events = Counter(
            "kvyard_router_kv_events", "KV events applied to the prefix index", ["worker"], registry=r
        )
        self.shadow = Counter(
            "kvyard_router_shadow_requests", "Requests mirrored to the shadow candidate, by outcome: sent, ok, "
            "failed, skipped_busy (too many in flight), skipped_down (failing), filtered", ["outcome"], registry=r
        )
        r.register(_WorkerCollector(workers))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
