"""A tensor-parallel replica's ranks placed by Ray: one placement group, a bundle per rank.

The controller reserves the replica's placement group with a bundle for every rank (kvyard/cluster/controller.py)
and starts the `ReplicaActor`, rank 0 (the engine that schedules, and its HTTP server), in bundle 0. When that
engine starts its ranks and finds itself in such a group, it starts a `RankActor` in each other bundle instead
of spawning local processes; Ray puts them wherever the bundles landed, on other nodes as well.

- The group's collectives go through gloo over TCP when the bundles span nodes (shared memory only when all sit
  on rank 0's node). Rank 0's node address hosts the group's rendezvous.
- Each step's inputs go from rank 0 to each rank over a ZeroMQ PUSH/PULL socket (a local replica's pipes
  cannot cross nodes), which admits only a peer with the group's token (kvyard/cluster/auth.py); the ranks
  follow them as spawned ranks do (kvyard/parallel/ranks.py).
- A `RayRank` stands for a rank actor where the engine expects a process: it joins, is alive, and is killed.
  Removing the placement group (the controller replacing or stopping the replica) kills every rank with it.
"""

import logging
import time
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from kvyard.cluster.auth import guard_server_socket, new_token, present_token
from kvyard.net import free_port
from kvyard.parallel.comm import join_group, leave_group
from kvyard.parallel.ranks import Workers, follow

if TYPE_CHECKING:
    from kvyard.config import EngineConfig

log = logging.getLogger(__name__)

LINGER_MS = 1000  # how long a closed step socket may still try to deliver (a STOP to a rank)


def current_placement(size: int) -> Any | None:
    """The Ray placement group this process runs in, if it has a bundle for every one of `size` ranks."""
    try:
        import ray
        from ray.util import get_current_placement_group
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    pg = get_current_placement_group()
    return pg if pg is not None and len(pg.bundle_specs) >= size else None


class StepSocket:
    """Rank 0's end of a rank's step channel: a pipe's send_bytes and close over ZeroMQ. Only a peer with the
    group's token connects (a PUSH socket shares its messages out over whoever connects)."""

    def __init__(self, host: str, token: str):
        import zmq

        self.context = zmq.Context()  # its own: the authenticator holds the context's ZAP endpoint
        self.socket = self.context.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, LINGER_MS)
        self.auth = guard_server_socket(self.context, self.socket, token)
        self.port = self.socket.bind_to_random_port(f"tcp://{host}")

    def send_bytes(self, data: bytes) -> None:
        self.socket.send(data, copy=False)

    def close(self) -> None:
        self.socket.close()
        if self.auth is not None:
            self.auth.stop()
        self.context.term()


class StepInbox:
    """A rank's end: a pipe's poll and recv_bytes over ZeroMQ."""

    def __init__(self, address: str, token: str):
        import zmq

        self.socket = zmq.Context.instance().socket(zmq.PULL)
        present_token(self.socket, token)
        self.socket.connect(address)

    def poll(self, timeout_s: float) -> bool:
        return bool(self.socket.poll(int(timeout_s * 1000)))

    def recv_bytes(self) -> bytes:
        return self.socket.recv()


class RayRank:
    """A rank actor, where the engine expects a rank's process."""

    def __init__(self, actor: Any, done: Any, rank: int):
        self.actor, self.done, self.name, self.pid = actor, done, f"kvyard-rank-{rank}", None

    def join(self, timeout: float | None = None) -> None:
        import ray

        ray.wait([self.done], timeout=timeout)

    def is_alive(self) -> bool:
        import ray

        ready, _ = ray.wait([self.done], timeout=0)
        return not ready

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)


def rank_actor_name(pg: Any, rank: int) -> str:
    """Rank actors are named after their placement group, so that they can be found (and told apart in logs)."""
    return f"kvyard-rank-{rank}-{pg.id.hex()}"


class RankActor:
    """Rank `rank` of a replica: its share of the engine, following rank 0's steps."""

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def run(self, rank: int, size: int, master: str, cfg: dict[str, Any], steps: str, token: str) -> None:
        from kvyard.config import EngineConfig
        from kvyard.engine.llm_engine import LLMEngine

        join_group(rank, size, master, comm=cfg["tensor_parallel_comm"], driven=True)
        try:
            follow(LLMEngine(EngineConfig(**cfg)), StepInbox(steps, token), parent=None)
        finally:
            leave_group()


def start_ray_ranks(cfg: "EngineConfig", size: int, pg: Any) -> Workers:
    """Start ranks 1..size-1 in bundles 1..size-1 of `pg` and join the group as rank 0."""
    import ray
    from ray.util.placement_group import placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    host = ray.util.get_node_ip_address()
    nodes = placement_group_table(pg)["bundles_to_node_id"]
    if len({nodes[b] for b in range(size)}) > 1:
        cfg = replace(cfg, tensor_parallel_comm="gloo")  # shared memory holds on one node only
    master = f"{host}:{free_port(host)}"
    token = new_token()  # the step sockets' own: it travels to the ranks through Ray, on no command line
    sockets, ranks = [], []
    started = time.monotonic()
    for rank in range(1, size):
        bundle = pg.bundle_specs[rank]
        socket = StepSocket(host, token)
        actor = ray.remote(RankActor).options(
            num_cpus=bundle.get("CPU", 1), resources={k: v for k, v in bundle.items() if k not in ("CPU", "memory")},
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
            name=rank_actor_name(pg, rank), max_concurrency=2).remote()  # run, and node_id meanwhile
        threads = int(bundle.get("CPU", 1))
        done = actor.run.remote(rank, size, master, asdict(replace(cfg, num_threads=threads)),
                                f"tcp://{host}:{socket.port}", token)
        sockets.append(socket)
        ranks.append(RayRank(actor, done, rank))
    try:
        join_group(0, size, master, comm=cfg.tensor_parallel_comm, driven=True)
    except BaseException:
        Workers(ranks, sockets).stop(timeout=1)  # type: ignore[arg-type]
        raise
    log.info("%d ranks placed by Ray on nodes %s in %.1f s", size, sorted({nodes[b][:8] for b in range(size)}),
             time.monotonic() - started)
    return Workers(ranks, sockets)  # type: ignore[arg-type]
