"""`RayController`: places kvyard replicas on a Ray cluster, tells the router where they are, and replaces
the ones that die.

Each replica is a `ReplicaActor` in a placement group of its own. The router learns the replicas from the
controller (the endpoint each actor reports), not from a list of URLs. Every replica has one
`run_until_stopped` call outstanding; when its actor or its node dies Ray fails that call, and the router
marks the worker dead at once (its prefix-index entries and predictions are dropped with it) rather than
after its HTTP health checks, and a replacement is placed on a live node.
"""

import asyncio
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvyard.cluster.auth import new_token
from kvyard.cluster.autoscaler import Autoscaler, ScalePolicy
from kvyard.cluster.config import ClusterConfig
from kvyard.cluster.placement import reserve
from kvyard.cluster.replica import ReplicaActor, parse_serve_argv
from kvyard.router.observed import Observed

log = logging.getLogger(__name__)


@dataclass
class Replica:
    role: str
    actor: Any
    pg: PlacementGroup
    url: str = ""
    node_id: str = ""
    stopped: Any = None  # the outstanding run_until_stopped ObjectRef
    info: dict[str, Any] = field(default_factory=dict)  # what the actor reported when it became ready


@dataclass
class RayController:
    cluster: ClusterConfig
    serve_argv: list[str]  # `kvyard serve` flags every replica gets (model, dtype, ...)
    roles: list[str]
    host: str | None = None  # the address every replica binds; None: each its own Ray node's address
    deploy: dict[str, Any] | None = None  # the deployment file's engine and server sections, for every replica
    replicas: list[Replica] = field(default_factory=list)
    replacements: int = 0
    stopping: bool = False
    placed: int = 0  # replicas placed so far: numbers each placement group's name, which must stay unique
    events: list[tuple[str, str]] = field(default_factory=list)  # ("died" | "replaced" | ..., url), oldest first
    retired: set[str] = field(default_factory=set)  # URLs of replicas removed on purpose (autoscaling down)
    # The deployment's cluster token: every replica's, and the router's (kvyard/cluster/auth.py).
    token: str = field(default_factory=new_token, repr=False)
    autoscaler: Autoscaler | None = None
    _tasks: set["asyncio.Task[None]"] = field(default_factory=set)

    @staticmethod
    def connect(address: str | None, host: str = "127.0.0.1") -> None:
        """Join the cluster at `address`, or start a local Ray instance bound to `host` (a cluster's nodes
        have their addresses already)."""
        if ray.is_initialized():
            return
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(_node_ip_address=host, include_dashboard=False, log_to_driver=False)

    # ---- placing replicas (blocking: Ray calls) ------------------------------------------------------

    def start_all(self) -> list[str]:
        """Place every replica and wait until each serves; returns their URLs. Raises PlacementError, or
        ValueError for serve flags that would not parse (checked here, before anything is placed)."""
        for role in set(self.roles):
            parse_serve_argv(self._argv(role), self.deploy)
        self.replicas = [self._place(role) for role in self.roles]
        for r in self.replicas:
            self._wait_ready(r)
        return [r.url for r in self.replicas]

    def _place(self, role: str) -> Replica:
        c = self.cluster
        self.placed += 1
        argv = self._argv(role)
        ranks = parse_serve_argv(argv, self.deploy)[0].tensor_parallel_size  # a bundle per rank, rank 0 in the first
        pg = reserve(c.bundle(), c.strategy, c.placement_timeout, name=f"kvyard-{role}-{self.placed}-{os.getpid()}",
                     count=ranks)
        actor = (
            ray.remote(ReplicaActor)
            .options(
                num_cpus=c.cpus_per_replica,
                resources=c.resources or None,
                max_concurrency=4,  # run_until_stopped stays outstanding while wait_ready answers
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
            )
            .remote(argv, c.cpus_per_replica, self.host, self.deploy, self.token)
        )
        return Replica(role, actor, pg)

    def _argv(self, role: str) -> list[str]:
        argv = [*self.serve_argv, "--role", role, "--kv-events-port", "0"]
        return argv + ["--kv-transfer-port", "0"] if role == "prefill" else argv

    def _wait_ready(self, r: Replica) -> None:
        info = ray.get(r.actor.wait_ready.remote(self.cluster.ready_timeout))
        r.url, r.node_id, r.info = info["url"], info["node_id"], info
        r.stopped = r.actor.run_until_stopped.remote()
        log.info("replica %s (%s) on node %s", r.url, r.role, r.node_id[:12])

    def _start(self, role: str) -> Replica:
        """Place a replica and wait until it serves (blocking: run it in a thread from the event loop)."""
        r = self._place(role)
        try:
            self._wait_ready(r)
        except BaseException:
            ray.kill(r.actor, no_restart=True)  # nothing of a replica that never served is left behind
            remove_placement_group(r.pg)
            raise
        return r

    def stop(self) -> None:
        self.stopping = True  # the deaths this causes are not failures: nothing is replaced
        for r in self.replicas:
            ray.kill(r.actor, no_restart=True)
            remove_placement_group(r.pg)
        self.replicas = []

    def describe(self) -> list[dict[str, str]]:
        return [{"url": r.url, "role": r.role, "node_id": r.node_id} for r in self.replicas]

    # ---- watching (on the router's event loop) -------------------------------------------------------

    async def watch(self, registry: Any, observed: Any = None) -> None:
        """Follow every replica's death signal for as long as the router runs, and autoscale when configured."""
        for r in self.replicas:
            self._watch_one(registry, r)
        if self.cluster.scaling is not None:
            self.autoscaler = Autoscaler(ScalePolicy(self.cluster.scaling), self, registry, observed or Observed())
            self._keep(asyncio.create_task(self.autoscaler.run(), name="kvyard-autoscaler"))

    async def add_replica(self, registry: Any, role: str = "both", why: str = "added") -> Replica:
        """Place one more replica, wait until it serves, and route to it."""
        r = await asyncio.to_thread(self._start, role)
        self.replicas.append(r)
        await registry.add(r.url)
        self.events.append((why, r.url))
        self._watch_one(registry, r)
        return r

    async def retire(self, registry: Any, url: str) -> None:
        """Remove a replica on purpose (the caller drained it first): its death is not a failure."""
        r = next(x for x in self.replicas if x.url == url)
        self.retired.add(url)
        self.replicas = [x for x in self.replicas if x is not r]
        registry.forget(url)
        ray.kill(r.actor, no_restart=True)
        remove_placement_group(r.pg)
        self.events.append(("retired", url))
        log.info("replica %s retired", url)

    def _keep(self, task: "asyncio.Task[None]") -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _watch_one(self, registry: Any, r: Replica) -> None:
        self._keep(asyncio.create_task(self._on_death(registry, r), name=f"kvyard-watch-{r.url}"))

    async def _on_death(self, registry: Any, r: Replica) -> None:
        try:
            await asyncio.wrap_future(r.stopped.future())
            reason = "its server stopped"
        except Exception as e:  # noqa: BLE001 - RayActorError, node death, a failed server
            reason = f"Ray reports the actor dead ({type(e).__name__})"
        if self.stopping or r.url in self.retired:
            return
        w = registry.workers.get(r.url)
        if w is not None:  # dead at once: out of the rotation, its prefix-index entries and predictions dropped
            registry.mark_dead(w, reason)
        self.events.append(("died", r.url))
        self.replicas = [x for x in self.replicas if x is not r]
        remove_placement_group(r.pg)
        if not self.cluster.replace_dead:
            return
        try:
            new = await self.add_replica(registry, r.role, why="replaced")
        except Exception as e:  # noqa: BLE001 - logged; the deployment serves with the others
            log.error("could not replace replica %s: %s", r.url, e)
            return
        registry.forget(r.url)  # listed as dead (with Ray's reason) until its replacement took its place
        self.replacements += 1
        log.info("replica %s replaced by %s on node %s", r.url, new.url, new.node_id[:12])

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
