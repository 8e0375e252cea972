"""Prometheus metrics of one app, in a registry of its own so several apps can live in one process.

Latencies and token counts are observed by the server as outputs pass through it; engine state
(running, waiting, KV usage, preemptions) is read from the engine's stats snapshot when scraped.
"""

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kvyard.server.async_engine import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily("kvyard_num_requests_running", "Requests in the engine's running batch",
                                value=s.num_running)
        yield GaugeMetricFamily("kvyard_num_requests_waiting", "Requests queued for the engine (waiting + pending)",
                                value=s.num_waiting + s.num_pending)
        yield GaugeMetricFamily("kvyard_kv_cache_usage_ratio", "Fraction of KV blocks in use",
                                value=s.kv_cache_usage)
        yield GaugeMetricFamily("kvyard_kv_cache_free_blocks", "Free KV blocks", value=s.num_free_blocks)
        yield GaugeMetricFamily("kvyard_kv_cache_blocks", "KV blocks in the pool", value=s.num_total_blocks)
        yield GaugeMetricFamily("kvyard_kv_held_transfers", "Prefilled prompts whose KV waits for a decode worker",
                                value=s.num_held_kv)
        yield CounterMetricFamily("kvyard_num_preemptions", "Requests preempted to free KV blocks",
                                  value=s.num_preemptions)
        yield CounterMetricFamily("kvyard_rank_restarts", "Times the other ranks of this tensor-parallel replica "
                                  "were restarted as a gang", value=s.rank_restarts)
        yield CounterMetricFamily("kvyard_prefill_chunks_limited",
                                  "Prompt chunks shortened so that running streams keep their inter-token target",
                                  value=s.num_limited_chunks)
        # Hit rate in tokens = hits / queries, taken over any window with rate() on both counters.
        yield CounterMetricFamily("kvyard_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=s.prefix_cache_queried_tokens)
        yield CounterMetricFamily("kvyard_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  value=s.prefix_cache_hit_tokens)
        yield GaugeMetricFamily("kvyard_prefix_cache_blocks", "KV blocks registered in the prefix cache",
                                value=s.num_cached_blocks)
        # Speculative decoding: acceptance rate = accepted / proposed, mean accepted length per step =
        # emitted / verify_steps, drafter time per step = rate of drafter seconds / rate of steps.
        yield CounterMetricFamily("kvyard_spec_proposed_tokens", "Draft tokens verified",
                                  value=s.spec_proposed_tokens)
        yield CounterMetricFamily("kvyard_spec_accepted_tokens", "Draft tokens accepted",
                                  value=s.spec_accepted_tokens)
        yield CounterMetricFamily("kvyard_spec_verify_steps", "Request steps that verified drafts",
                                  value=s.spec_verify_steps)
        yield CounterMetricFamily("kvyard_spec_emitted_tokens", "Tokens emitted by request steps that verified drafts",
                                  value=s.spec_emitted_tokens)
        yield CounterMetricFamily("kvyard_spec_drafter_seconds", "Time spent drafting", value=s.spec_drafter_seconds)
        if s.moe_expert_tokens:
            yield _counts("kvyard_moe_expert_tokens", "Tokens routed to each expert, summed over the MoE layers",
                          "expert", s.moe_expert_tokens)
            if s.moe_rank_tokens:
                yield _counts("kvyard_moe_rank_tokens", "Expert parallelism: tokens routed to the experts each rank "
                              "holds, summed over the MoE layers", "rank", s.moe_rank_tokens)
            yield GaugeMetricFamily("kvyard_moe_imbalance", "Per MoE layer, the busiest expert's routed tokens "
                                    "over the mean expert's, averaged over the layers (1 = even)", value=s.moe_imbalance)
        if s.offload:
            yield from _offload_metrics(s)
        yield CounterMetricFamily("kvyard_num_steps", "Engine steps", value=s.num_steps)
        yield CounterMetricFamily("kvyard_engine_step_seconds", "Time inside engine steps (the rest of the engine "
                                  "thread's time goes to HTTP, queues and the GIL)", value=s.step_seconds)


def _counts(name: str, documentation: str, label: str, counts: tuple[int, ...]) -> Metric:
    """A counter per index (an expert, a rank): `name{label="i"}` = counts[i]."""
    family = CounterMetricFamily(name, documentation, labels=[label])
    for i, count in enumerate(counts):
        family.add_metric([str(i)], count)
    return family


def _offload_metrics(s: EngineStats) -> Iterator[Metric]:
    """The KV offload tiers (kvyard/offload/): hits, writes, size and fallbacks, labelled by tier."""
    hits = CounterMetricFamily("kvyard_kv_offload_hit_tokens", "Prompt tokens whose KV came back from a tier",
                               labels=["tier"])
    stored = CounterMetricFamily("kvyard_kv_offload_stored_blocks", "KV blocks written to a tier", labels=["tier"])
    evicted = CounterMetricFamily("kvyard_kv_offload_evicted_blocks", "KV blocks a tier dropped for room",
                                  labels=["tier"])
    size = GaugeMetricFamily("kvyard_kv_offload_bytes", "Bytes of KV a tier holds", labels=["tier"])
    fallbacks = CounterMetricFamily("kvyard_kv_offload_fallbacks", "Tier entries that could not serve or be written "
                                    "(missing, corrupt, dropped, write_errors): their requests recompute",
                                    labels=["tier", "reason"])
    moved = CounterMetricFamily("kvyard_kv_offload_moved_bytes", "KV bytes moved between the pool and a tier",
                                labels=["tier", "direction"])
    load_time = CounterMetricFamily("kvyard_kv_offload_load_seconds", "Time spent reading blocks back from a tier "
                                    "into the pool", labels=["tier"])
    for tier, c in s.offload.items():
        moved.add_metric([tier, "load"], c["bytes_loaded"])
        moved.add_metric([tier, "store"], c["bytes_stored"])
        load_time.add_metric([tier], c["load_seconds"])
        hits.add_metric([tier], c["restored"] * s.block_size)
        stored.add_metric([tier], c["stored"])
        evicted.add_metric([tier], c["evicted"])
        size.add_metric([tier], c["bytes"])
        for key, value in c.items():
            if key.startswith("fallback_"):
                fallbacks.add_metric([tier, key.removeprefix("fallback_")], value)
    decisions = CounterMetricFamily("kvyard_kv_offload_decisions", "Blocks a tier held, loaded or (cheaper) "
                                    "recomputed", labels=["decision"])
    decisions.add_metric(["load"], s.offload_loaded)
    decisions.add_metric(["recompute"], s.offload_recomputed)
    saved = CounterMetricFamily("kvyard_kv_offload_saved_seconds", "Prefill time the loaded blocks saved, net of "
                                "loading them (estimated from the step-cost model and the tiers' rates)",
                                value=s.offload_saved_seconds)
    not_admitted = CounterMetricFamily("kvyard_kv_offload_not_admitted_blocks", "Blocks not written to the tiers: "
                                       "fewer prompts than --kv-offload-admit-after carried them",
                                       value=s.offload_not_admitted)
    yield from (hits, stored, evicted, size, moved, load_time, fallbacks, decisions, saved, not_admitted)


class CaptureCollector(Collector):
    """Traffic capture's counts (kvyard/shadow/capture.py): records written, and dropped (a full queue, a
    failed write)."""

    def __init__(self, capture: Any):
        self.capture = capture

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("kvyard_capture_records", "Requests written to the capture",
                                  value=self.capture.records)
        yield CounterMetricFamily("kvyard_capture_dropped", "Requests the capture dropped (its queue full, or a "
                                  "write failed); serving never waits on it", value=self.capture.dropped)


class VisionCollector(Collector):
    """A served graft's image work (kvyard/vision/runtime.py): encoder runs, and images its cache answered."""

    def __init__(self, vision: Any):
        self.vision = vision

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("kvyard_vision_encoder_runs", "Images the encoder and projector turned into soft "
                                  "tokens", value=self.vision.encoder_runs)
        yield CounterMetricFamily("kvyard_vision_cache_hits", "Images whose soft tokens came from the cache (the "
                                  "same bytes seen before)", value=self.vision.cache_hits)


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvyard_requests", "Finished engine requests (choices) by outcome: a finish_reason, or "
            "error / timeout / cancelled / shutdown", ["outcome"], registry=r)
        self.rejected = Counter(
            "kvyard_rejected_requests", "HTTP requests refused before reaching the engine, by reason",
            ["reason"], registry=r)
        self.ttft = Histogram("kvyard_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kvyard_inter_token_latency_seconds", "Time between tokens of one request",
                             buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvyard_e2e_request_latency_seconds", "Arrival to the final output",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvyard_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("kvyard_generation_tokens", "Generated tokens", registry=r)
        # The repetition guard (server/repetition.py): every loop it caught, by what it did about it
        # ("stop": the choice ended with finish_reason "repetition"; "retry": it was generated again),
        # and how each retry ended ("recovered": no loop this time; "repeated": it looped again).
        self.repetition_guard_trips = Counter(
            "kvyard_repetition_guard_trips", "Times the repetition guard intervened, by action", ["action"],
            registry=r)
        self.repetition_guard_retries = Counter(
            "kvyard_repetition_guard_retries", "Generations the repetition guard started again, by outcome",
            ["outcome"], registry=r)
        r.register(_EngineCollector(stats))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
