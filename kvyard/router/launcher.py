"""`kvyard up`: N `kvyard serve` workers on consecutive ports (and optionally the router) as child processes.

Workers publish KV events on free ports (announced in /kv/config), split the machine's cores between
them, and die with their parent (PR_SET_PDEATHSIG on Linux), so a killed `kvyard up` leaves no orphans.
A worker that dies is reaped and started again after a backoff that doubles while it keeps dying
(`Cluster.supervise`); the router's health checks take it out and re-admit it after a new handshake.
"""

import ctypes
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from kvyard.cluster.auth import TOKEN_ENV, new_token
from kvyard.errors import KvyardError

SHARED_CORES_SPIN_COUNT = 10000
log = logging.getLogger("kvyard.up")


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead worker is started again: after `backoff` s, doubled at each death up to `max_backoff`,
    and back to `backoff` for a worker that had stayed up `stable_after` s. backoff 0: never restart."""

    backoff: float = 1.0
    max_backoff: float = 30.0
    stable_after: float = 60.0


@dataclass
class ClusterSpec:
    replicas: int
    model: str
    # Per worker: both (colocated), or prefill / decode for a disaggregated deployment (`--prefill N --decode M`).
    roles: list[str] = field(default_factory=list)
    worker_port: int = 8001  # the first worker's; the others follow
    host: str = "127.0.0.1"
    num_threads: int | None = None  # per worker; default: the cores split evenly
    serve_args: list[str] = field(default_factory=list)  # more `kvyard serve` flags for every worker
    log_dir: Path | None = None  # worker logs go here; None: inherit our stdout/stderr
    api_key: str | None = field(default=None, repr=False)  # the workers' key, in their environment (not argv)
    # The deployment's cluster token (kvyard/cluster/auth.py): every worker's and the router's, drawn anew.
    cluster_token: str = field(default_factory=new_token, repr=False)

    def __post_init__(self) -> None:
        self.roles = self.roles or ["both"] * self.replicas
        self.replicas = len(self.roles)

    def threads(self) -> int:
        if self.num_threads:
            return self.num_threads
        if "prefill" in self.roles:
            # Prefill and decode workers take turns more than they compete: each gets every core (measured
            # against a split in BENCHMARKS.md, "Prefill/decode disaggregation").
            return os.cpu_count() or 1
        return max(1, (os.cpu_count() or 1) // self.replicas)

    def worker_env(self) -> dict[str, str]:
        """The workers' environment. Workers that share cores (more threads in all than cores) get a shorter libgomp
        spin: after each parallel region an idle thread spins up to 300,000 rounds by default (milliseconds), taking
        the core from the other worker when that one has work; 10,000 still bridges a decode step's regions. With
        the default, `kvyard bench disagg --threads shared` gave the streams' ITL p99 0.27x colocated's and long
        prompts 6.5x the TTFT; with 100 (libgomp's own short spin) short-only throughput fell to 0.55x; with 10,000
        ITL p99 3.14x better, short-only 0.94x (BENCHMARKS.md, session 21). A worker alone on its cores keeps the
        default, which its decode steps need (kvyard/server/async_engine.py)."""
        env = dict(os.environ, **{TOKEN_ENV: self.cluster_token})
        if self.api_key:
            env["KVYARD_API_KEY"] = self.api_key
        shares_cores = self.threads() * self.replicas > (os.cpu_count() or 1)
        if shares_cores and "GOMP_SPINCOUNT" not in env and "OMP_WAIT_POLICY" not in env:
            env["GOMP_SPINCOUNT"] = str(SHARED_CORES_SPIN_COUNT)
        return env

    def worker_urls(self) -> list[str]:
        return [f"http://{self.host}:{self.worker_port + i}" for i in range(self.replicas)]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def kvyard_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvyard.cli.main", *args]


class ChildProcess:
    def __init__(self, name: str, cmd: list[str], log_path: Path | None, env: dict[str, str] | None = None):
        self.name = name
        self.cmd = cmd
        self.env = env
        self.log: IO[str] | None = open(log_path, "w") if log_path else None  # noqa: SIM115 - closed in stop()
        self.restarts = 0
        self.delay = 0.0  # the backoff before its last restart
        self.restart_at: float | None = None  # when it is due to start again, once seen dead
        self._spawn()

    def _spawn(self) -> None:
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT if self.log else None,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )

    def tend(self, policy: RestartPolicy, now: float) -> None:
        """One supervisor look: reap it if it exited (poll() waits for it, so no zombie stays) and start it
        again once its backoff has passed."""
        if self.proc.poll() is None:
            return
        if self.restart_at is None:
            stable = now - self.started_at >= policy.stable_after
            self.delay = policy.backoff if stable or not self.delay else min(2 * self.delay, policy.max_backoff)
            self.restart_at = now + self.delay
            log.warning("%s exited with status %s after %.0f s; restarting in %.0f s", self.name,
                        self.proc.returncode, now - self.started_at, self.delay)
        elif now >= self.restart_at:
            self.restart_at = None
            self.restarts += 1
            self._spawn()
            log.info("%s restarted (pid %d, restart %d)", self.name, self.proc.pid, self.restarts)

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.log:
            self.log.close()


class Cluster:
    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.workers: list[ChildProcess] = []
        self.router: ChildProcess | None = None
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None

    def supervise(self, policy: RestartPolicy, interval: float = 0.5) -> None:
        """Restart dead workers in the background until `stop()`."""
        if policy.backoff <= 0:
            return

        def loop() -> None:
            while not self._stopping.wait(interval):
                for child in self.workers:
                    child.tend(policy, time.monotonic())

        self._supervisor = threading.Thread(target=loop, name="kvyard-up-supervisor", daemon=True)
        self._supervisor.start()

    def start_workers(self) -> list[str]:
        s = self.spec
        for i, url in enumerate(s.worker_urls()):
            cmd = kvyard_command(
                "serve",
                "--model",
                s.model,
                "--host",
                s.host,
                "--port",
                str(s.worker_port + i),
                "--kv-events-port",
                "0",
                "--num-threads",
                str(s.threads()),
                "--role",
                s.roles[i],
                *(["--kv-transfer-port", "0"] if s.roles[i] == "prefill" else []),
                *s.serve_args,
            )
            log = s.log_dir / f"worker{i}.log" if s.log_dir else None
            self.workers.append(ChildProcess(f"{s.roles[i]} worker {i} ({url})", cmd, log, s.worker_env()))
        return s.worker_urls()

    def start_router(self, port: int, policy: str, route_args: list[str] = ()) -> str:  # type: ignore[assignment]
        s = self.spec
        cmd = kvyard_command(
            "route",
            "--model",
            s.model,
            "--host",
            s.host,
            "--port",
            str(port),
            "--policy",
            policy,
            *[a for u in s.worker_urls() for a in ("--worker", u)],
            *route_args,
        )
        self.router = ChildProcess("router", cmd, s.log_dir / "router.log" if s.log_dir else None,
                                   dict(os.environ, **{TOKEN_ENV: s.cluster_token}))
        return f"http://{s.host}:{port}"

    def wait_ready(self, urls: list[str], timeout: float, path: str = "/health") -> None:
        """Wait until every URL answers 200 on `path`; fail early when one of our processes exits."""
        deadline = time.monotonic() + timeout
        pending = list(urls)
        while pending:
            for child in self.children():
                if child.proc.poll() is not None:
                    raise KvyardError(f"{child.name} exited with status {child.proc.returncode}")
            try:
                if httpx.get(pending[0] + path, timeout=2.0, trust_env=False).status_code == 200:
                    pending.pop(0)
                    continue
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise KvyardError(f"{pending[0]} did not become ready within {timeout:g} s")
            time.sleep(0.3)

    def children(self) -> list[ChildProcess]:
        return self.workers + ([self.router] if self.router else [])

    def stop(self) -> None:
        self._stopping.set()  # no restarts from here on
        if self._supervisor is not None:
            self._supervisor.join(5)
        # SIGTERM to all first, so they drain in parallel; then wait for each.
        for child in self.children():
            if child.proc.poll() is None:
                child.proc.terminate()
        for child in self.children():
            child.stop()


def split_args(text: str | None) -> list[str]:
    return shlex.split(text) if text else []
