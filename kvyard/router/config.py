"""`RouterSettings`: everything `kvyard route` can be told, with checked ranges."""

from dataclasses import dataclass, field
from typing import Any

from kvyard.cluster.auth import HEADER, token_from_env
from kvyard.config import section_setting
from kvyard.errors import ConfigError
from kvyard.shadow.mirror import ShadowSettings

POLICIES = ("kv", "round-robin", "least-loaded", "random")


@dataclass
class RouterSettings:
    workers: list[str] = field(default_factory=list)  # base URLs, e.g. http://127.0.0.1:8001
    model: str = "smollm2-135m"  # whose tokenizer the router hashes prompts with (the workers' model)
    policy: str = "kv"
    host: str = "127.0.0.1"
    port: int = 8000
    block_size: int | None = None  # None: take the first worker's (the handshake checks the rest agree)
    # kv policy: cost = prefill_weight * uncached blocks + load_weight * blocks of requests in flight.
    prefill_weight: float = 1.0
    load_weight: float = 0.5
    temperature: float = 0.0  # > 0: pick by softmax over normalised costs instead of the minimum
    # Hot-spot protection: a worker is skipped while it has more than factor * mean + slack requests in flight.
    hot_spot_factor: float = 1.5
    hot_spot_slack: float = 1.0
    predicted_ttl: float = 10.0  # seconds an assignment counts as cached there before events confirm it
    health_interval: float = 1.0  # seconds between health checks of each worker
    health_timeout: float = 2.0
    dead_after: int = 2  # consecutive failed checks before a worker leaves the rotation
    max_attempts: int = 3  # workers a request is tried on when connecting fails before any byte
    request_timeout: float = 600.0
    register_timeout: float = 300.0  # how long startup waits for every worker to answer the handshake
    # Prefill/decode disaggregation (when prefill workers are registered): a prompt is prefilled remotely when
    # at least this many of its tokens are cached on no decode worker, and a prefill worker has fewer than
    # `max_prefills_in_flight` prompts in progress; otherwise its decode worker prefills it locally.
    disagg_threshold: int = 256
    max_prefills_in_flight: int = 2
    seed: int | None = None  # seeds the random choices (random policy, ties, softmax)
    # Clients must send `Authorization: Bearer api_key` (every route but /health); None: no auth.
    api_key: str | None = field(default=None, repr=False)
    # The key the router sends to workers (handshake, health, metrics, requests); None: api_key, else the
    # client's own Authorization header is passed through.
    worker_api_key: str | None = field(default=None, repr=False)
    # The fleet's cluster token, for the workers' /kv/* and KV events (kvyard/cluster/auth.py); `kvyard up`
    # draws one per deployment. None: $KVYARD_CLUSTER_TOKEN, else none.
    cluster_token: str | None = field(default=None, repr=False)
    log_level: str = "info"
    # A candidate deployment that sees a mirrored share of the traffic (kvyard/shadow/mirror.py): its URL, or
    # {url, sample, routes, models, max_in_flight, timeout_s, dead_after, retry_after_s, keep}; None: off
    shadow: ShadowSettings | dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        checks = [
            ("policy", self.policy in POLICIES, f"must be one of {', '.join(POLICIES)}"),
            ("port", 0 <= self.port <= 65535, "must be in [0, 65535]"),
            ("block_size", self.block_size is None or self.block_size >= 1, "must be >= 1"),
            ("prefill_weight", self.prefill_weight >= 0, "must be >= 0"),
            ("load_weight", self.load_weight >= 0, "must be >= 0"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("hot_spot_factor", self.hot_spot_factor >= 1, "must be >= 1"),
            ("hot_spot_slack", self.hot_spot_slack >= 0, "must be >= 0"),
            ("predicted_ttl", self.predicted_ttl >= 0, "must be >= 0"),
            ("health_interval", self.health_interval > 0, "must be > 0"),
            ("dead_after", self.dead_after >= 1, "must be >= 1"),
            ("max_attempts", self.max_attempts >= 1, "must be >= 1"),
            ("disagg_threshold", self.disagg_threshold >= 0, "must be >= 0"),
            ("max_prefills_in_flight", self.max_prefills_in_flight >= 1, "must be >= 1"),
            ("api_key", self.api_key is None or bool(self.api_key), "must not be empty"),
            ("worker_api_key", self.worker_api_key is None or bool(self.worker_api_key), "must not be empty"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ConfigError(f"router setting {name} {why}, got {getattr(self, name)!r}", param=name)
        self.workers = [w.rstrip("/").removesuffix("/v1") for w in self.workers]
        if self.worker_api_key is None:
            self.worker_api_key = self.api_key
        self.cluster_token = self.cluster_token or token_from_env()
        self.shadow = section_setting(ShadowSettings, self.shadow, "router setting shadow", shorthand="url")

    def worker_headers(self) -> dict[str, str]:
        """Headers on every request the router sends a worker."""
        headers = {"authorization": f"Bearer {self.worker_api_key}"} if self.worker_api_key else {}
        return headers | ({HEADER: self.cluster_token} if self.cluster_token else {})
