"""One worker as the router sees it: its address, handshake result, health and the load we put on it."""

import asyncio
import enum
from dataclasses import dataclass, field

from kvyard.server.kv_config import KVConfig


class WorkerStatus(enum.Enum):
    PENDING = "pending"  # not answered the handshake yet
    HEALTHY = "healthy"
    DEAD = "dead"  # failed health checks or a connection; re-checked and re-admitted when it answers
    REFUSED = "refused"  # its hashing scheme differs from ours: never routed to


@dataclass(eq=False)
class Worker:
    url: str
    status: WorkerStatus = WorkerStatus.PENDING
    config: KVConfig | None = None
    error: str | None = None  # why it is dead or refused
    failures: int = 0  # consecutive failed health checks
    # Load the router itself put on the worker (exact, immediate):
    in_flight: int = 0
    in_flight_blocks: int = 0  # prompt blocks of the requests in flight, the kv policy's load term
    # Sampled from the worker's /metrics by the health checker:
    running: float = 0.0
    waiting: float = 0.0
    prefix_queries: float = 0.0  # prompt tokens it looked up in its prefix cache
    prefix_hits: float = 0.0
    kv_usage: float = 0.0  # fraction of its KV blocks in use
    repetition_trips: float = 0.0  # times its repetition guard intervened
    prefills_in_flight: int = 0  # prompts this router is having it prefill for a decode worker
    draining: bool = False  # being removed (autoscaling down): no new requests, the ones in flight finish
    # Set when the worker is declared dead, so its in-flight requests stop waiting for it at once.
    dead: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def role(self) -> str:
        return self.config.role if self.config else "both"

    def serves_adapter(self, name: str) -> bool:
        return self.config is not None and name in self.config.lora_adapters

    def serves(self, pool: str) -> bool:
        """Whether the worker belongs to a pool: `decode` (generates) or `prefill` (prefills for others)."""
        if pool == "prefill":
            return self.role != "decode" and self.config is not None and self.config.kv_transfer_endpoint is not None
        return self.role != "prefill"

    @property
    def routable(self) -> bool:
        return self.status is WorkerStatus.HEALTHY and not self.draining

    @property
    def observed_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def describe(self) -> dict[str, object]:
        return {
            "url": self.url,
            "role": self.role,
            "status": self.status.value,
            "draining": self.draining,
            "error": self.error,
            "in_flight": self.in_flight,
            "in_flight_blocks": self.in_flight_blocks,
            "running": self.running,
            "waiting": self.waiting,
            "observed_hit_rate": self.observed_hit_rate,
            "kv_usage": self.kv_usage,
            "repetition_trips": self.repetition_trips,
            "instance_id": self.config.instance_id if self.config else None,
            "events_endpoint": self.config.events_endpoint if self.config else None,
        }
