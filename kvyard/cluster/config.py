"""`ClusterConfig`: what `kvyard up --ray` asks of the Ray cluster (the deployment file's `cluster:` section)."""

from dataclasses import dataclass, field

from kvyard.errors import ConfigError

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class ClusterConfig:
    address: str | None = None  # auto, ray://host:port or a GCS address; None: start a local Ray instance
    cpus_per_replica: int = 1  # each replica's bundle asks for this many CPUs, and runs this many torch threads
    strategy: str = "PACK"  # of each replica's placement group (one bundle, so PACK and SPREAD place alike)
    # Extra custom resources each replica's bundle asks for (e.g. {"node-a": 0.01} to pin it to a node).
    resources: dict[str, float] = field(default_factory=dict)
    placement_timeout: float = 30.0  # seconds to wait for a placement group before failing with what is missing
    ready_timeout: float = 300.0  # seconds a replica may take to load its model and answer /health
    replace_dead: bool = True  # start a replacement when a replica's actor dies

    def __post_init__(self) -> None:
        checks = [
            ("cpus_per_replica", self.cpus_per_replica >= 1, "must be >= 1"),
            ("strategy", self.strategy in STRATEGIES, f"must be one of {', '.join(STRATEGIES)}"),
            ("placement_timeout", self.placement_timeout > 0, "must be > 0"),
            ("ready_timeout", self.ready_timeout > 0, "must be > 0"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ConfigError(f"cluster setting {name} {why}, got {getattr(self, name)!r}", param=name)

    def bundle(self) -> dict[str, float]:
        return {"CPU": float(self.cpus_per_replica), **self.resources}
