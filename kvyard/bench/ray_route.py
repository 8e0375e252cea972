"""`kvyard bench ray`: the same deployment placed by Ray against local `kvyard up`, in one run.

    kvyard bench ray --model smollm2-135m --replicas 2 --cpus-per-replica 1 \\
        --workload random --input-len 128 --output-len 64 --concurrency 16 --num-requests 64

1. local: `kvyard up`'s launcher (workers and router as processes) runs `bench serve`'s workload;
2. ray: a simulated Ray cluster on loopback (a head with no CPUs, `replicas` nodes of `cpus_per_replica`
   CPUs) and `kvyard up --ray ADDRESS` as users start it run the same workload: throughput and TTFT p50
   against local's, local and Ray taking turns for `--rounds` rounds, and where the machine's CPU went in
   each cell (Ray's daemons, Ray's threads inside the replicas and the router, the rest: cpu_account.py);
3. recovery: on a cluster with a node to spare, the node of one replica is removed; the time until the
   router marks it dead and until a request is served by its replacement;
4. autoscale: `kvyard up --ray` with `cluster.autoscale` (1 to `replicas` replicas) under a load step (one
   client, then `--concurrency` clients, then none): the replicas serving over time, as JSON and a PNG.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import httpx

from kvyard.bench.route import _wait_all_healthy, measure, run_cell
from kvyard.bench.serve_run import BenchError
from kvyard.errors import KvyardError
from kvyard.router.launcher import kvyard_command

LOOPBACK = "127.0.0.1"


def add_ray_bench_parser(sub: argparse._SubParsersAction) -> None:
    from kvyard.bench.serve import add_workload_args

    p = sub.add_parser("ray", help="`kvyard up --ray` on a simulated cluster against local `kvyard up`")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--cpus-per-replica", type=int, default=1, help="CPUs (and torch threads) of each replica")
    p.add_argument("--router-port", type=int, default=8300, help="the router's port; local workers the next ones")
    p.add_argument("--serve-args", default=None, help="more `kvyard serve` flags for each worker")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--phases", default="local,ray,recovery,autoscale", help="which phases to run, in order")
    p.add_argument("--rounds", type=int, default=3, help="local and ray cells, taking turns (default 3)")
    p.add_argument("--step-seconds", type=float, default=60.0, help="autoscale: how long the high load lasts")
    p.add_argument("--out-dir", default="bench-results/ray", help="report.json, the PNG and the process logs")
    add_workload_args(p)
    p.set_defaults(func=run_ray_bench)


@contextmanager
def simulated_cluster(nodes: int, cpus: int, resources: dict[str, float] | None = None):
    """A Ray cluster on loopback: a head with no CPUs (for drivers) and `nodes` worker nodes of `cpus` CPUs (and
    `resources` each), this process connected as a driver. Nodes that stop answering are declared dead within
    about 1.5 s, as a lost machine would be with tighter health checks than Ray's default."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only
    import ray
    from ray.cluster_utils import Cluster

    fast_death = {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                  "health_check_initial_delay_ms": 0}
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "node_ip_address": LOOPBACK, "include_dashboard": False, "_system_config": fast_death})
    for _ in range(nodes):
        cluster.add_node(num_cpus=cpus, node_ip_address=LOOPBACK, resources=resources or {})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@contextmanager
def ray_deployment(args: argparse.Namespace, address: str, log: Path, *flags: str, serve_args: str = ""):
    """`kvyard up --ray ADDRESS ...` as a process, until its router answers; the router's URL."""
    serve = " ".join(a for a in (args.serve_args, serve_args) if a)
    cmd = kvyard_command("up", "--ray", address, "--model", args.model or "smollm2-135m", "--router-port",
                         str(args.router_port), "--cpus-per-replica", str(args.cpus_per_replica),
                         "--log-level", "info", *(["--serve-args", serve] if serve else []), *flags)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    router = f"http://{LOOPBACK}:{args.router_port}"
    try:
        deadline = time.monotonic() + args.startup_timeout
        while not _answers(router):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"`kvyard up --ray` did not start its router (see {log})")
            time.sleep(0.5)
        yield router
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def serving(router: str) -> list[str]:
    workers = httpx.get(router + "/workers", timeout=5, trust_env=False).json()["workers"]
    return [w["url"] for w in workers if w["status"] == "healthy" and not w.get("draining")]


def recovery(cluster: Any, router: str, timeout: float = 180.0) -> dict[str, float]:
    """Remove the node of one replica; seconds until the router marked it dead and until a request was
    served by its replacement (a worker URL not seen before)."""
    import ray

    before = set(serving(router))
    # Each replica has a placement group of its own (kvyard/cluster/controller.py): the node of its bundle.
    groups = [g for g in ray.util.placement_group_table().values()
              if g["state"] == "CREATED" and g["name"].startswith("kvyard-")]
    node_id = groups[0]["bundles_to_node_id"][0]
    victim = next(n for n in cluster.worker_nodes if n.node_id == node_id)
    t0 = time.monotonic()
    cluster.remove_node(victim, allow_graceful=False)
    marked = served = None
    while time.monotonic() - t0 < timeout and served is None:
        if marked is None and len(set(serving(router)) & before) < len(before):
            marked = time.monotonic() - t0
        try:
            r = httpx.post(router + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=10,
                           trust_env=False)
            if r.status_code == 200 and r.headers.get("x-kvyard-worker") not in before:
                served = time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    if served is None:
        raise BenchError(f"no replacement served within {timeout:g} s of the node loss")
    return {"marked_dead_s": marked if marked is not None else served, "first_served_by_replacement_s": served}


def load_step(router: str, concurrency: int, step_s: float, max_tokens: int) -> list[tuple[float, int, int]]:
    """One client for 15 s, `concurrency` clients for `step_s`, then none for 60 s, sampling every 0.5 s
    (seconds since the start, clients, replicas serving)."""
    clients = [0]
    stop = threading.Event()

    def client(i: int) -> None:
        # Streamed, as chat clients ask: the router times each stream's first token (a scaling signal).
        body = {"prompt": f"Client {i} asks: tell me a story.", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True}
        while not stop.is_set():
            if i >= clients[0]:
                time.sleep(0.1)
                continue
            try:
                with httpx.stream("POST", router + "/v1/completions", json=body, timeout=120, trust_env=False) as r:
                    for _ in r.iter_lines():
                        pass
            except httpx.HTTPError:
                time.sleep(0.1)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    samples, t0 = [], time.monotonic()
    for until, n in ((15.0, 1), (15.0 + step_s, concurrency), (75.0 + step_s, 0)):
        clients[0] = n
        while time.monotonic() - t0 < until:
            samples.append((round(time.monotonic() - t0, 2), n, len(serving(router))))
            time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(130)
    return samples


def plot(samples: list[tuple[float, int, int]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s[0] for s in samples]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.step(t, [s[2] for s in samples], where="post", label="replicas serving", linewidth=2)
    ax.step(t, [s[1] for s in samples], where="post", label="clients (closed loop)", alpha=0.6)
    ax.set_xlabel("seconds")
    ax.set_ylabel("count")
    ax.set_title("kvyard up --ray: autoscaling under a load step")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


CELL_BRIEF = ("failed", "output_throughput", "ttft_p50_ms", "serving_cpu_share", "ray_threads_cpu_share",
              "ray_daemons_cpu_share")


def run_ray_bench(args: argparse.Namespace) -> int:
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"benchmark": "ray", "model": args.model or "smollm2-135m", "replicas": args.replicas,
                              "cpus_per_replica": args.cpus_per_replica, "workload": args.workload}
    report["local"], report["ray"] = [], []
    local_args = argparse.Namespace(**{**vars(args), "num_threads": args.cpus_per_replica,
                                       "route_args": "--log-level warning"})
    try:
        for i in range(args.rounds if {"local", "ray"} & set(phases) else 0):
            # Local runs with no Ray on the machine; each Ray cell on a fresh cluster, so Ray's daemons count.
            if "local" in phases:
                print(f"bench ray: round {i + 1}, local kvyard up", file=sys.stderr)
                report["local"].append(run_cell(local_args, args.replicas, "kv", out_dir))
            if "ray" in phases:
                print(f"bench ray: round {i + 1}, kvyard up --ray", file=sys.stderr)
                with simulated_cluster(args.replicas, args.cpus_per_replica) as cluster:
                    report["ray"].append(ray_cell(args, cluster.address, out_dir))
        spare = simulated_cluster(args.replicas + 1, args.cpus_per_replica)  # one node to spare
        with spare if {"recovery", "autoscale"} & set(phases) else nullcontext() as cluster:
            if "recovery" in phases:
                print("bench ray: a node lost", file=sys.stderr)
                with ray_deployment(args, cluster.address, out_dir / "up-recovery.log", "--replicas",
                                    str(args.replicas)) as r:
                    _wait_all_healthy(r, args.replicas, args.startup_timeout)
                    report["recovery"] = recovery(cluster, r)
            if "autoscale" in phases:
                print("bench ray: autoscaling under a load step", file=sys.stderr)
                config = out_dir / "autoscale.yaml"
                config.write_text(
                    "cluster:\n  replicas: 1\n  autoscale:\n    min_replicas: 1\n"
                    f"    max_replicas: {args.replicas}\n    target_waiting: 2\n    ttft_target_s: 0.5\n"
                    "    up_after_s: 2\n    down_after_s: 20\n    cooldown_s: 5\n")
                # A replica takes at most 8 requests at once, as an operator sizes it for its latency target;
                # more queue in its engine, which is the signal to add one.
                with ray_deployment(args, cluster.address, out_dir / "up-autoscale.log", "--config", str(config),
                                    serve_args="--max-num-seqs 8") as r:
                    samples = load_step(r, args.concurrency or 16, args.step_seconds, args.output_len)
                report["autoscale"] = {"samples": samples, "max_replicas_seen": max(s[2] for s in samples),
                                       "final_replicas": samples[-1][2]}
                plot(samples, out_dir / "autoscale.png")
    except (BenchError, KvyardError) as e:
        print(f"kvyard bench ray: error: {e}", file=sys.stderr)
        return 1
    report["ratios"] = ratios(report["local"], report["ray"])
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    brief = {k: v for k, v in report.items() if k not in ("local", "ray", "autoscale")}
    for k in ("local", "ray"):
        brief[k] = [{m: c.get(m) for m in CELL_BRIEF}
                    for c in report[k]]
    if "autoscale" in report:
        brief["autoscale"] = {k: v for k, v in report["autoscale"].items() if k != "samples"}
    print(json.dumps(brief, indent=2))
    return 1 if any(c["failed"] for c in report["local"] + report["ray"]) else 0


def ratios(local: list[dict[str, Any]], ray_: list[dict[str, Any]]) -> dict[str, Any]:
    """Ray against local per round, and the ratio of the medians."""
    if not local or len(local) != len(ray_):
        return {}
    out: dict[str, Any] = {}
    for name, key in (("ray/local output throughput", "output_throughput"), ("ray/local TTFT p50", "ttft_p50_ms")):
        rounds = [r[key] / c[key] for c, r in zip(local, ray_, strict=True)]
        out[name] = {"median_ratio": statistics.median(r[key] for r in ray_) / statistics.median(c[key] for c in local),
                     "rounds": rounds}
    return out


def ray_cell(args: argparse.Namespace, address: str, out_dir: Path) -> dict[str, Any]:
    """The workload through `kvyard up --ray`; `measure` splits the machine's CPU time meanwhile into Ray's
    daemons, Ray's threads inside the replicas and the router, and the rest."""
    with ray_deployment(args, address, out_dir / "up-ray.log", "--replicas", str(args.replicas)) as r:
        _wait_all_healthy(r, args.replicas, args.startup_timeout)
        return {"replicas": args.replicas, "policy": "kv", **measure(args, r, serving(r))}
