"""`kvyard bench disagg`: colocated against disaggregated serving on the same machine, in one run.

    kvyard bench disagg --model smollm2-135m --streams 4 --long-prompt 2000 --long-count 4 --long-interval 8

Each deployment is `kvyard up` (launcher + router, workers as processes): colocated is one worker with
every thread; disaggregated is a prefill and a decode worker, each with every thread as `kvyard up` starts
them (`--threads split` halves them instead). Two workloads run on each:

* mixed: `--streams` decode streams (short prompts, long outputs, one request after another) run while
  `--long-count` long prompts arrive every `--long-interval` seconds. Reported: the streams' inter-token
  latency p50/p99 (what a long prefill does to everyone else's stream) and the long prompts' TTFT.
* short only: `--short-requests` short prompts at `--short-concurrency`; conditional disaggregation keeps
  them all local, and must not be slower than colocated (output tokens/s and TTFT). Both deployments stay
  up for the whole run and the `--short-rounds` rounds alternate between them (medians, and each round's
  ratio): a difference that small is otherwise lost in the machine's drift between two runs.

Also: KV transfer throughput (bytes the decode worker pulled / time its pulls took, from its metrics)
against the loopback TCP bandwidth measured in the same run, idle before the deployments start and again
during the mixed workload (the limit under the same load as the pulls).
"""

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvyard.bench.route import _wait_all_healthy, delta, scrape
from kvyard.bench.serve_client import RequestResult, stream_request
from kvyard.bench.serve_metrics import distribution
from kvyard.bench.serve_workloads import TextSource, load_tokenizer
from kvyard.disagg.bandwidth import loopback_tcp_gbps
from kvyard.router.launcher import Cluster, ClusterSpec, split_args

_PCTS = [50.0, 99.0]
LOOPBACK_PROBE_BYTES = 48 << 20  # about one long prompt's KV (2,000 tokens of SmolLM2: 46 MB)


def add_disagg_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("disagg", help="colocated vs prefill/decode disaggregated serving (ITL, TTFT, transfer)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", default="shared", choices=("split", "shared"),
                   help="disaggregated workers each use all the cores (default, as `kvyard up`) or split them")
    p.add_argument("--total-threads", type=int, default=None, help="torch threads in all (default: cores)")
    p.add_argument("--streams", type=int, default=4, help="concurrent decode streams (mixed workload)")
    p.add_argument("--stream-prompt", type=int, default=64, help="tokens per decode stream prompt")
    p.add_argument("--stream-output", type=int, default=64, help="tokens per decode stream response")
    p.add_argument("--long-prompt", type=int, default=2000, help="tokens per long prompt")
    p.add_argument("--long-output", type=int, default=8)
    p.add_argument("--long-count", type=int, default=4)
    p.add_argument("--long-interval", type=float, default=8.0, help="seconds between long prompts")
    p.add_argument("--short-requests", type=int, default=16, help="short-only workload: requests")
    p.add_argument("--short-concurrency", type=int, default=4)
    p.add_argument("--short-rounds", type=int, default=3,
                   help="short-only rounds per deployment, alternating between them (medians)")
    p.add_argument("--router-port", type=int, default=8300)
    p.add_argument("--serve-args", default=None, help="more `kvyard serve` flags for every worker")
    p.add_argument("--route-args", default=None, help="more `kvyard route` flags")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--out-dir", default="bench-results/disagg")
    p.set_defaults(func=run_disagg_bench)


def _body(text: str, max_tokens: int) -> dict[str, Any]:
    return {"prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


async def mixed(url: str, args: argparse.Namespace, texts: TextSource) -> dict[str, Any]:
    """Decode streams run until every long prompt is done; the stream tokens that arrive between the first long
    prompt and the end of the last count."""
    stop = asyncio.Event()
    streams: list[RequestResult] = []
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=None, trust_env=False) as client:

        async def stream_loop() -> None:
            while not stop.is_set():
                body = _body(texts.text(args.stream_prompt), args.stream_output)
                streams.append(await stream_request(client, "/v1/completions", body, 600, start, args.stream_output))

        async def long_prompt(delay: float) -> RequestResult:
            await asyncio.sleep(delay)
            body = _body(texts.text(args.long_prompt), args.long_output)
            return await stream_request(client, "/v1/completions", body, 600, start, args.long_output)

        async def loopback_under_load() -> float:
            """Loopback TCP while the streams run (between long prompts): the limit under the same load."""
            await asyncio.sleep(warmup + args.long_interval / 2)
            return statistics.median([await asyncio.to_thread(loopback_tcp_gbps, LOOPBACK_PROBE_BYTES)
                                      for _ in range(3)])

        loops = [asyncio.create_task(stream_loop()) for _ in range(args.streams)]
        warmup = 3.0
        probe = asyncio.create_task(loopback_under_load())
        longs = await asyncio.gather(*(long_prompt(warmup + i * args.long_interval) for i in range(args.long_count)))
        stop.set()
        await asyncio.gather(*loops)
    ok_longs = [r for r in longs if r.ok]
    end = max((r.start + (r.e2e or 0.0) for r in ok_longs), default=float("inf"))
    itls = [gap for r in streams if r.ok for t, gap in _token_gaps(r) if warmup <= t <= end]
    return {
        "stream_requests": len(streams),
        "failed": sum(not r.ok for r in streams + longs),
        "itl_ms": distribution(itls, _PCTS),
        "long_ttft_ms": distribution([r.ttft for r in ok_longs if r.ttft is not None], _PCTS),
        "long_prompt_tokens": [r.prompt_tokens for r in ok_longs],
        "loopback_tcp_gbps_under_load": await probe,
    }


def _token_gaps(r: RequestResult) -> list[tuple[float, float]]:
    """(when the token arrived, seconds after the run started; the gap before it) for every gap of a stream."""
    t = r.start + (r.ttft or 0.0)
    out = []
    for gap in r.itls:
        t += gap
        out.append((t, gap))
    return out


async def short_only(url: str, args: argparse.Namespace, texts: TextSource) -> dict[str, Any]:
    prompts = [texts.text(args.stream_prompt) for _ in range(args.short_requests)]
    gate = asyncio.Semaphore(args.short_concurrency)
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=None, trust_env=False) as client:

        async def one(text: str) -> RequestResult:
            async with gate:
                body = _body(text, args.stream_output)
                return await stream_request(client, "/v1/completions", body, 600, start, args.stream_output)

        results = await asyncio.gather(*(one(t) for t in prompts))
    elapsed = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    return {
        "failed": len(results) - len(ok),
        "output_throughput": sum(r.output_tokens for r in ok) / elapsed,
        "ttft_ms": distribution([r.ttft for r in ok if r.ttft is not None], _PCTS),
        "itl_ms": distribution([x for r in ok for x in r.itls], _PCTS),
    }


class Deployment:
    """One `kvyard up` (workers and router) kept up for the whole run, with its counters since start."""

    def __init__(self, name: str, roles: list[str], threads: int, port: int, args: argparse.Namespace,
                 out_dir: Path):
        log_dir = out_dir / name
        log_dir.mkdir(parents=True, exist_ok=True)
        spec = ClusterSpec(replicas=len(roles), roles=roles, model=args.model, worker_port=port + 1,
                           num_threads=threads, serve_args=split_args(args.serve_args), log_dir=log_dir)
        self.name, self.roles, self.threads, self.port, self.args = name, roles, threads, port, args
        self.cluster = Cluster(spec)
        # The same seed on both deployments: they see the same prompts in the same order.
        self.texts = TextSource(random.Random(args.seed), load_tokenizer(args.model))
        self.workers: list[str] = []
        self.router = ""

    def __enter__(self) -> "Deployment":
        try:
            self.workers = self.cluster.start_workers()
            self.cluster.wait_ready(self.workers, self.args.startup_timeout)
            self.router = self.cluster.start_router(self.port, "kv", split_args(self.args.route_args))
            self.cluster.wait_ready([self.router], self.args.startup_timeout)
            _wait_all_healthy(self.router, len(self.roles), self.args.startup_timeout)
        except BaseException:
            self.cluster.stop()
            raise
        self._before = self._scrape()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cluster.stop()

    def _scrape(self) -> tuple[dict[str, Any], Any]:
        return {w: scrape(w) for w in self.workers}, scrape(self.router)

    def counters(self) -> dict[str, Any]:
        (workers, router), (w0, r0) = self._scrape(), self._before
        pulled = sum(delta(workers[w], w0[w], "kvyard_kv_pulled_bytes_total") for w in self.workers)
        seconds = sum(delta(workers[w], w0[w], "kvyard_kv_pull_seconds_sum") for w in self.workers)
        return {"kv_pulled_bytes": pulled, "kv_transfer_gbps": pulled / seconds / 1e9 if seconds else None,
                "disagg_decisions": {d: delta(router, r0, "kvyard_router_disagg_decisions_total", decision=d)
                                     for d in ("remote", "short", "saturated", "prefill_failed")}}


def summarize_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Short-only rounds of one deployment: medians, and every round."""
    return {"failed": sum(r["failed"] for r in rounds),
            "output_throughput": statistics.median(r["output_throughput"] for r in rounds),
            "ttft_ms": {"p50": statistics.median(r["ttft_ms"]["p50"] for r in rounds)},
            "rounds": rounds}


def run_deployments(args: argparse.Namespace, out_dir: Path, total: int, per_worker: int) -> list[dict[str, Any]]:
    """Both deployments up at once (the idle one waits on its queues): the mixed workload on each in turn,
    then short-only rounds alternating between them, so that a noisy neighbour hits both alike."""
    with (Deployment("colocated", ["both"], total, args.router_port, args, out_dir) as co,
          Deployment("disaggregated", ["prefill", "decode"], per_worker, args.router_port + 10, args, out_dir) as dis):
        deps = (co, dis)
        results = [{"deployment": d.name, "roles": d.roles, "threads_per_worker": d.threads,
                    "mixed": asyncio.run(mixed(d.router, args, d.texts))} for d in deps]
        rounds: list[list[dict[str, Any]]] = [[], []]
        for _ in range(args.short_rounds):
            for i, d in enumerate(deps):
                rounds[i].append(asyncio.run(short_only(d.router, args, d.texts)))
        for result, d, rs in zip(results, deps, rounds, strict=True):
            result["short_only"] = summarize_rounds(rs)
            result.update(d.counters())
    return results


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(colocated: dict[str, Any], disagg: dict[str, Any], loopback_gbps: float) -> dict[str, Any]:
    c, d = colocated["mixed"], disagg["mixed"]

    def pct(run: dict[str, Any], key: str, p: str) -> float | None:
        return (run[key] or {}).get(p)

    per_round = [_ratio(b["output_throughput"], a["output_throughput"])
                 for a, b in zip(colocated["short_only"].get("rounds", []), disagg["short_only"].get("rounds", []),
                                 strict=True)]

    return {
        "itl_p50_colocated_over_disagg": _ratio(pct(c, "itl_ms", "p50"), pct(d, "itl_ms", "p50")),
        "itl_p99_colocated_over_disagg": _ratio(pct(c, "itl_ms", "p99"), pct(d, "itl_ms", "p99")),
        "long_ttft_p50_disagg_over_colocated": _ratio(pct(d, "long_ttft_ms", "p50"), pct(c, "long_ttft_ms", "p50")),
        "short_only_throughput_disagg_over_colocated": _ratio(disagg["short_only"]["output_throughput"],
                                                              colocated["short_only"]["output_throughput"]),
        "short_only_ttft_p50_disagg_over_colocated": _ratio(pct(disagg["short_only"], "ttft_ms", "p50"),
                                                            pct(colocated["short_only"], "ttft_ms", "p50")),
        "short_only_throughput_per_round": per_round,
        # Rounds alternate, so round i of each ran under the same conditions: the paired estimate.
        "short_only_throughput_paired_median": statistics.median(per_round) if per_round else None,
        "loopback_tcp_gbps": loopback_gbps,
        "transfer_over_loopback": _ratio(disagg["kv_transfer_gbps"], loopback_gbps),
        "loopback_tcp_gbps_under_load": d["loopback_tcp_gbps_under_load"],
        "transfer_over_loopback_under_load": _ratio(disagg["kv_transfer_gbps"], d["loopback_tcp_gbps_under_load"]),
    }


def run_disagg_bench(args: argparse.Namespace) -> int:
    import os

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    total = args.total_threads or os.cpu_count() or 1
    per_worker = total if args.threads == "shared" else max(1, total // 2)
    loopback = loopback_tcp_gbps(256 << 20)
    colocated, disagg = run_deployments(args, out_dir, total, per_worker)
    report = {"args": {k: v for k, v in vars(args).items() if k != "func"}, "total_threads": total,
              "colocated": colocated, "disaggregated": disagg, "ratios": compare(colocated, disagg, loopback)}
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))
    json.dump(report["ratios"], sys.stdout, indent=2)
    print()
    for dep in (colocated, disagg):
        m, s = dep["mixed"], dep["short_only"]
        print(f"{dep['deployment']:>14}: stream ITL p50/p99 {m['itl_ms']} ms, long TTFT {m['long_ttft_ms']} ms, "
              f"short-only {s['output_throughput']:.1f} tok/s, transfer {dep['kv_transfer_gbps']} GB/s, "
              f"decisions {dep['disagg_decisions']}")
    return 0
