"""`ReplicaActor`: one kvyard worker (engine + HTTP server) inside a Ray actor.

The server runs in the actor's own process, so the actor dying and the worker dying are one event, which
the controller hears from Ray at once. The actor pins torch's threads to the CPUs its placement group
reserved (Ray would otherwise leave OMP_NUM_THREADS at the CPUs asked for, or 1), and names its Ray node as
the KV transfer's host identity, so two replicas on different Ray nodes never try shared memory.
"""

import os
import threading
import time
from typing import Any

import httpx

from kvyard.net import free_port


def parse_serve_argv(argv: list[str], deploy: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """`kvyard serve` flags over the deployment file's `engine:` and `server:` sections (`deploy`) ->
    (EngineConfig, ServerSettings). A bad flag raises ValueError: argparse's own exit would kill the actor (and
    the Ray worker with it) with nothing but a usage line in its log."""
    from kvyard.cli.main import build_parser
    from kvyard.cli.serve import configs_from_args
    from kvyard.server.config import DeployConfig

    try:
        args = build_parser().parse_args(["serve", *argv])
    except SystemExit:
        shown = ["***" if i and argv[i - 1] == "--api-key" else a for i, a in enumerate(argv)]  # keep keys out of logs
        raise ValueError(f"invalid `kvyard serve` flags for a replica: {' '.join(shown)}") from None
    return configs_from_args(args, DeployConfig(**deploy) if deploy else None)


class ReplicaActor:
    def __init__(self, serve_argv: list[str], num_threads: int, host: str | None = None,
                 deploy: dict[str, Any] | None = None, cluster_token: str | None = None):
        """`host`: the address the worker binds; None: its Ray node's own address (on a real cluster every
        node has another one, and the router reaches each replica there)."""
        import ray

        host = host or ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
        os.environ["KVYARD_NODE_ID"] = self.node_id  # kvyard/disagg/wire.py: same node id or no shm
        import torch

        torch.set_num_threads(num_threads)
        self.engine_config, self.settings = parse_serve_argv([*serve_argv, "--num-threads", str(num_threads)],
                                                             deploy)
        self.settings.host, self.settings.port = host, free_port(host)
        self.settings.cluster_token = cluster_token or self.settings.cluster_token
        self.url = f"http://{host}:{self.settings.port}"
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="kvyard-replica", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        from kvyard.server.lifecycle import serve

        try:
            serve(self.engine_config, self.settings)
        except BaseException as e:  # noqa: BLE001 - reported through wait_ready / run_until_stopped
            self.error = e

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Block until the server answers /health; return where to reach it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise RuntimeError(f"the replica's server exited: {self.error!r}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0, trust_env=False).status_code == 200:
                    return self.describe()
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the replica at {self.url} did not answer /health within {timeout:g} s")

    def describe(self) -> dict[str, Any]:
        import torch

        return {
            "url": self.url, "node_id": self.node_id, "role": self.settings.role, "pid": os.getpid(),
            "torch_threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        }

    def run_until_stopped(self) -> None:
        """Returns when the server stops; the controller keeps one call outstanding as its death signal."""
        while self._thread.is_alive():
            self._thread.join(1.0)
        if self.error is not None:
            raise RuntimeError(f"the replica's server failed: {self.error!r}")
