"""`ClusterConfig`: what `kvyard up` deploys and, with `--ray`, what it asks of the Ray cluster (the
deployment file's `cluster:` section; flags override it). `AutoscaleConfig` is its `autoscale:` part."""

from dataclasses import dataclass, field
from typing import Any

from kvyard.config import check_fields
from kvyard.errors import ConfigError

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def _check(section: str, obj: Any, checks: list[tuple[str, bool, str]]) -> None:
    for name, ok, why in checks:
        if not ok:
            raise ConfigError(f"{section} setting {name} {why}, got {getattr(obj, name)!r}", param=name)


@dataclass
class AutoscaleConfig:
    """When to add or remove colocated replicas (kvyard/cluster/autoscaler.py). The signals are the ones that
    say a replica is overloaded: requests queued in its engine, its KV cache filling up, and the router's TTFT
    against a target. Request counts are not used: their rate says nothing about how heavy each request is."""

    min_replicas: int = 1
    max_replicas: int = 4
    target_waiting: float = 2.0  # requests queued per replica (mean) above which it scales up
    max_kv_usage: float = 0.85  # KV-cache usage (mean over replicas) above which it scales up
    ttft_target_s: float | None = None  # the router's TTFT p50 over the last window above which it scales up
    up_after_s: float = 3.0  # an overload must last this long before a replica is added (hysteresis)
    down_after_s: float = 30.0  # every replica idle this long before one is removed (hysteresis)
    cooldown_s: float = 15.0  # no decision for this long after the last one took effect
    interval_s: float = 1.0  # seconds between looks at the signals
    drain_timeout_s: float = 120.0  # a replica being removed finishes its requests within this, else it is cut

    def __post_init__(self) -> None:
        _check("autoscale", self, [
            ("min_replicas", self.min_replicas >= 1, "must be >= 1"),
            ("max_replicas", self.max_replicas >= self.min_replicas, "must be >= min_replicas"),
            ("target_waiting", self.target_waiting > 0, "must be > 0"),
            ("max_kv_usage", 0 < self.max_kv_usage <= 1, "must be in (0, 1]"),
            ("ttft_target_s", self.ttft_target_s is None or self.ttft_target_s > 0, "must be > 0"),
            ("up_after_s", self.up_after_s >= 0, "must be >= 0"),
            ("down_after_s", self.down_after_s >= 0, "must be >= 0"),
            ("cooldown_s", self.cooldown_s >= 0, "must be >= 0"),
            ("interval_s", self.interval_s > 0, "must be > 0"),
            ("drain_timeout_s", self.drain_timeout_s > 0, "must be > 0"),
        ])


@dataclass
class ClusterConfig:
    replicas: int = 2  # colocated replicas (role both), when prefill and decode are 0
    prefill: int = 0  # disaggregated: prefill replicas (with decode)
    decode: int = 0  # disaggregated: decode replicas (with prefill)
    address: str | None = None  # --ray: auto, ray://host:port or a GCS address; None: start a local Ray instance
    cpus_per_replica: int = 1  # each replica's bundle asks for this many CPUs, and runs this many torch threads
    strategy: str = "PACK"  # of each replica's placement group (one bundle, so PACK and SPREAD place alike)
    # Extra custom resources each replica's bundle asks for (e.g. {"node-a": 0.01} to pin it to a node).
    resources: dict[str, float] = field(default_factory=dict)
    placement_timeout: float = 30.0  # seconds to wait for a placement group before failing with what is missing
    ready_timeout: float = 300.0  # seconds a replica may take to load its model and answer /health
    replace_dead: bool = True  # start a replacement when a replica's actor dies
    autoscale: AutoscaleConfig | dict[str, Any] | None = None  # None: a fixed number of replicas

    def __post_init__(self) -> None:
        if isinstance(self.autoscale, dict):
            self.autoscale = AutoscaleConfig(**check_fields(AutoscaleConfig, self.autoscale, "cluster: autoscale"))
        disaggregated = bool(self.prefill or self.decode)
        _check("cluster", self, [
            ("replicas", self.replicas >= 1, "must be >= 1"),
            ("prefill", not disaggregated or self.prefill >= 1, "must be >= 1 with decode replicas"),
            ("decode", not disaggregated or self.decode >= 1, "must be >= 1 with prefill replicas"),
            ("autoscale", self.autoscale is None or not disaggregated,
             "scales colocated replicas only; set it without prefill and decode"),
            ("cpus_per_replica", self.cpus_per_replica >= 1, "must be >= 1"),
            ("strategy", self.strategy in STRATEGIES, f"must be one of {', '.join(STRATEGIES)}"),
            ("placement_timeout", self.placement_timeout > 0, "must be > 0"),
            ("ready_timeout", self.ready_timeout > 0, "must be > 0"),
        ])
        scale = self.autoscale
        if isinstance(scale, AutoscaleConfig) and not scale.min_replicas <= self.replicas <= scale.max_replicas:
            raise ConfigError(f"cluster setting replicas must be within autoscale's [{scale.min_replicas}, "
                              f"{scale.max_replicas}], got {self.replicas}", param="replicas")

    @property
    def scaling(self) -> AutoscaleConfig | None:
        return self.autoscale if isinstance(self.autoscale, AutoscaleConfig) else None

    def roles(self) -> list[str]:
        """Each replica's role, in the order they are started."""
        if self.prefill or self.decode:
            return ["prefill"] * self.prefill + ["decode"] * self.decode
        return ["both"] * self.replicas

    def bundle(self) -> dict[str, float]:
        return {"CPU": float(self.cpus_per_replica), **self.resources}
