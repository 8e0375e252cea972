"""`kvyard bench route`: `bench serve` through the router, for several replica counts and policies in one run.

    kvyard bench route --model smollm2-135m --replicas 2,4 --policies kv,round-robin,least-loaded \\
        --workload multi-turn --turns 4 --concurrency 16 --num-requests 128 --out-dir bench-results/route

Every (replicas, policy) cell starts fresh workers and a fresh router (`kvyard up`'s launcher, router as
its own process), so no policy inherits another's warm caches, runs the same workload and stops them.
Per cell it reports TTFT p50/p99 and throughput (from `bench serve`), the router's hit accounting
(blocks the chosen worker held against the most any worker held: the oracle), the workers' own
prefix-cache hit rate in tokens, and the largest worker's share of requests. Then, per replica count,
the TTFT p50 and hit-rate ratios of the first policy to each other.
"""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvyard.bench import cpu_account
from kvyard.bench.serve_run import BenchError, run_benchmark
from kvyard.errors import KvyardError
from kvyard.router.config import POLICIES
from kvyard.router.launcher import Cluster, ClusterSpec, split_args


def add_route_bench_parser(sub: argparse._SubParsersAction) -> None:
    from kvyard.bench.serve import _ints, add_workload_args

    p = sub.add_parser("route", help="bench serve through `kvyard route`: replica counts x policies")
    p.add_argument(
        "--replicas", type=_ints, default=[2, 4], help="comma-separated replica counts (default 2,4)"
    )
    p.add_argument(
        "--policies", default="kv,round-robin,least-loaded", help="comma-separated routing policies"
    )
    p.add_argument(
        "--router-port", type=int, default=8200, help="the router's port; workers use the next ones"
    )
    p.add_argument(
        "--num-threads", type=int, default=None, help="torch threads per worker (default: cores / N)"
    )
    p.add_argument("--serve-args", default=None, help="more `kvyard serve` flags for each worker")
    p.add_argument("--route-args", default=None, help="more `kvyard route` flags")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--out-dir", default="bench-results/route", help="report.json and the process logs")
    add_workload_args(p)  # its --model is the model the workers serve
    p.set_defaults(func=run_route_bench)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def delta(after: dict, before: dict, name: str, **labels: str) -> float:
    """Sum of a counter's increase over the samples whose labels include `labels`."""
    total = 0.0
    for (n, lab), value in after.items():
        if n == name and all(dict(lab).get(k) == v for k, v in labels.items()):
            total += value - before.get((n, lab), 0.0)
    return total


def cell_stats(
    router_before: dict, router_after: dict, workers: dict[str, tuple[dict, dict]]
) -> dict[str, Any]:
    blocks = {
        k: delta(router_after, router_before, "kvyard_router_prefix_blocks_total", kind=k)
        for k in ("queried", "predicted_hit", "oracle_hit")
    }
    per_worker = {
        w: delta(router_after, router_before, "kvyard_router_requests_total", worker=w, outcome="200")
        for w in workers
    }
    hits = sum(delta(a, b, "kvyard_prefix_cache_hits_total") for b, a in workers.values())
    queries = sum(delta(a, b, "kvyard_prefix_cache_queries_total") for b, a in workers.values())
    total = sum(per_worker.values())
    return {
        "router_hit_blocks": blocks["predicted_hit"],
        "oracle_hit_blocks": blocks["oracle_hit"],
        "queried_blocks": blocks["queried"],
        "hit_rate_vs_oracle": blocks["predicted_hit"] / blocks["oracle_hit"]
        if blocks["oracle_hit"]
        else None,
        "observed_hit_rate": hits / queries if queries else None,  # the engines' own, in tokens
        "requests_per_worker": per_worker,
        "largest_worker_share": max(per_worker.values()) / total if total else None,
        "largest_over_mean": max(per_worker.values()) / (total / len(per_worker)) if total else None,
    }


def run_cell(args: argparse.Namespace, replicas: int, policy: str, out_dir: Path) -> dict[str, Any]:
    model = args.model or "smollm2-135m"
    log_dir = out_dir / f"r{replicas}-{policy}"
    log_dir.mkdir(parents=True, exist_ok=True)
    spec = ClusterSpec(
        replicas=replicas,
        model=model,
        worker_port=args.router_port + 1,
        num_threads=args.num_threads,
        serve_args=split_args(args.serve_args),
        log_dir=log_dir,
    )
    cluster = Cluster(spec)
    try:
        workers = cluster.start_workers()
        cluster.wait_ready(workers, args.startup_timeout)
        router = cluster.start_router(args.router_port, policy, split_args(args.route_args))
        cluster.wait_ready([router], args.startup_timeout)
        _wait_all_healthy(router, replicas, args.startup_timeout)
        cell = measure(args, router, workers)
    finally:
        cluster.stop()
    return {"replicas": replicas, "policy": policy, **cell}


def measure(args: argparse.Namespace, router: str, workers: list[str]) -> dict[str, Any]:
    """`bench serve`'s workload through `router`, with the router's and the workers' counters around it."""
    from kvyard.bench.serve import config_from_args

    before = scrape(router), {w: scrape(w) for w in workers}
    args_for_cell = argparse.Namespace(**{**vars(args), "model": None})  # requests use the served name
    threads0, t0 = cpu_account.snapshot(), time.monotonic()
    report = run_benchmark(config_from_args(args_for_cell, router))
    cpu = cpu_account.account(threads0, cpu_account.snapshot(), time.monotonic() - t0)
    after = scrape(router), {w: scrape(w) for w in workers}
    [run] = report["runs"]
    s = run["summary"]
    stats = cell_stats(before[0], after[0], {w: (before[1][w], after[1][w]) for w in workers})
    return {
        "completed": s["completed"],
        "failed": s["failed"],
        "ttft_p50_ms": (s["ttft_ms"] or {}).get("p50"),
        "ttft_p99_ms": (s["ttft_ms"] or {}).get("p99"),
        "request_throughput": s["request_throughput"],
        "output_throughput": s["output_throughput"],
        **stats,
        **cpu,
        "summary": s,
    }


def _wait_all_healthy(router: str, replicas: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ws = httpx.get(router + "/workers", timeout=5, trust_env=False).json()["workers"]
        if sum(w["status"] == "healthy" for w in ws) == replicas:
            return
        if any(w["status"] == "refused" for w in ws):
            raise BenchError(f"the router refused a worker: {ws}")
        time.sleep(0.3)
    raise BenchError("the router did not admit every worker in time")


def ratios(cells: list[dict[str, Any]], base: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in sorted({c["replicas"] for c in cells}):
        mine = {c["policy"]: c for c in cells if c["replicas"] == n}
        for other, c in mine.items():
            if other == base:
                continue
            b = mine[base]
            out[f"{n} replicas: {other}/{base} TTFT p50"] = _ratio(c["ttft_p50_ms"], b["ttft_p50_ms"])
            out[f"{n} replicas: {base}/{other} output throughput"] = _ratio(
                b["output_throughput"], c["output_throughput"]
            )
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def print_table(cells: list[dict[str, Any]], out: Any = None) -> None:
    out = out or sys.stderr

    def f(v: float | None, spec: str = ".1f") -> str:
        return "-" if v is None else format(v, spec)

    print(
        f"{'replicas':>8} {'policy':>13} {'TTFT p50':>9} {'TTFT p99':>9} {'req/s':>6} {'tok/s':>7} "
        f"{'hit/oracle':>10} {'obs hit':>7} {'max share':>9} {'failed':>6}",
        file=out,
    )
    for c in cells:
        print(
            f"{c['replicas']:>8} {c['policy']:>13} {f(c['ttft_p50_ms']):>9} {f(c['ttft_p99_ms']):>9} "
            f"{f(c['request_throughput'], '.2f'):>6} {f(c['output_throughput']):>7} "
            f"{f(c['hit_rate_vs_oracle'], '.2f'):>10} {f(c['observed_hit_rate'], '.2f'):>7} "
            f"{f(c['largest_worker_share'], '.2f'):>9} {c['failed']:>6}",
            file=out,
        )


def run_route_bench(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies or not args.replicas or min(args.replicas) < 1:
        print(
            f"kvyard bench route: error: policies from {', '.join(POLICIES)}, replicas >= 1", file=sys.stderr
        )
        return 2
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cells = []
    try:
        for n in args.replicas:
            for policy in policies:
                print(f"bench route: {n} replicas, policy {policy}", file=sys.stderr)
                cells.append(run_cell(args, n, policy, out_dir))
    except (BenchError, KvyardError) as e:
        print(f"kvyard bench route: error: {e}", file=sys.stderr)
        return 1
    report = {
        "benchmark": "route",
        "model": args.model or "smollm2-135m",
        "workload": args.workload,
        "policies": policies,
        "replicas": args.replicas,
        "ratios": ratios(cells, policies[0]),
        "cells": cells,
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print_table(cells)
    print(json.dumps({k: v for k, v in report.items() if k != "cells"}, indent=2))
    return 1 if any(c["failed"] for c in cells) else 0
