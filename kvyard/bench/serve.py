"""`kvyard bench serve`: latency and throughput of any OpenAI-compatible server (kvyard, llama.cpp, vLLM).

    kvyard bench serve --url http://127.0.0.1:8000 --workload random --concurrency 16 --num-requests 128
    kvyard bench serve --url ... --request-rate 4 --seed 1 --slo-ttft-ms 500 --slo-tpot-ms 100
    kvyard bench serve --url ... --sweep 1,4,16,32 --json-out r.json --plot-out r.png

Requests are streamed; the report gives TTFT, TPOT, ITL and end-to-end percentiles, request and
output-token throughput, goodput against the SLOs given, errors, and whether every request produced
the number of tokens asked for (`output_tokens_match`).
"""

import argparse
import json
import math
import sys
from typing import Any

from kvyard.bench.serve_load import LoadSpec
from kvyard.bench.serve_metrics import SLOs
from kvyard.bench.serve_run import BenchError, ServeBenchConfig, run_benchmark
from kvyard.bench.serve_workloads import WORKLOADS, WorkloadSpec


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_workload_args(p: argparse.ArgumentParser, loads: bool = True) -> None:
    """Workload, load and measurement flags, shared with `kvyard bench serve-compare` and (without the load
    flags: it searches the load itself) `kvyard tune`."""
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="random")
    w.add_argument("--num-requests", type=int, default=64, help="requests in all (multi-turn: turns in all)")
    w.add_argument("--input-len", type=int, default=128, help="prompt (or user turn) length in tokens")
    w.add_argument("--output-len", type=int, default=64, help="max_tokens of each request")
    w.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths vary uniformly within ±ratio of --input-len/--output-len")
    w.add_argument("--num-groups", type=int, default=4, help="shared-prefix: distinct system prompts")
    w.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: system prompt length in tokens")
    w.add_argument("--turns", type=int, default=3, help="multi-turn: user turns per conversation")
    w.add_argument("--history-len", type=int, default=0,
                   help="multi-turn: tokens of context unique to each conversation (a document, an earlier chat) "
                        "sent ahead of its first turn, as the system message")
    w.add_argument("--tokenizer", default=None,
                   help="build prompts from this model's tokens (kvyard model name, path or HF name); "
                        "default: common English words, about one token each")
    w.add_argument("--tool-share", type=float, default=0.3,
                   help="chat-tools: the share of requests that offer tools and ask for a call")
    w.add_argument("--seed", type=int, default=0, help="seeds the workload and the Poisson arrivals")
    if not loads:
        w.add_argument("--trace", default=None, help="replay this trace's prompts and arrivals (a kvyard capture, "
                       "Mooncake JSONL or Azure CSV), sped up as the load search needs")
        return
    ld = p.add_argument_group("load")
    ld.add_argument("--concurrency", type=int, default=None, help="closed loop: requests in flight (default 8)")
    ld.add_argument("--request-rate", type=float, default=None,
                    help="open loop: Poisson arrivals per second (inf: all at once)")
    ld.add_argument("--sweep", type=_ints, default=None, help="closed loop at each concurrency, e.g. 1,4,16,32")
    ld.add_argument("--trace", default=None, help="replay a trace's arrivals and prompts: a kvyard capture directory or "
                    "file, a Mooncake JSONL trace or an Azure CSV (kvyard/bench/trace.py)")
    ld.add_argument("--time-scale", type=float, default=1.0,
                    help="--trace: each request at its recorded offset times this (0.5: twice as fast)")
    add_request_args(p)


def add_slo_args(g: "argparse._ArgumentGroup | argparse.ArgumentParser") -> None:
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-tpot-ms", type=float, default=None)
    g.add_argument("--slo-e2e-ms", type=float, default=None)


def add_request_args(p: argparse.ArgumentParser) -> None:
    r = p.add_argument_group("requests and report")
    r.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos and min_tokens=max_tokens so every output has --output-len tokens")
    r.add_argument("--extra-body", type=json.loads, default={},
                   help='JSON merged into every request body, e.g. \'{"logit_bias": {"2": -100}}\'')
    r.add_argument("--timeout", type=float, default=300.0, help="seconds each request may take")
    r.add_argument("--warmup", type=int, default=1, help="short requests sent before measuring")
    r.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    r.add_argument("--keep-alive", action=argparse.BooleanOptionalAction, default=False,
                   help="reuse connections between requests (default: a new one per request)")
    r.add_argument("--percentiles", type=_floats, default=[50.0, 90.0, 99.0])
    add_slo_args(r)
    r.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_serve_bench_parsers(sub: argparse._SubParsersAction) -> None:
    """`bench serve`, and `bench serve-compare` (which starts the servers itself)."""
    p = sub.add_parser("serve", help="latency/throughput of a running OpenAI-compatible server")
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000 (loopback only)")
    p.add_argument("--json-out", default=None)
    p.add_argument("--plot-out", default=None, help="PNG with latency percentiles (and the sweep)")
    add_workload_args(p)
    p.set_defaults(func=run_serve_bench)

    from kvyard.bench.compare_serve import add_compare_parser

    add_compare_parser(sub)


def loads_from_args(args: argparse.Namespace) -> list[LoadSpec]:
    if args.trace is not None:
        if args.request_rate is not None or args.concurrency is not None or args.sweep:
            raise BenchError("--trace replays the recorded arrival times: no --request-rate, --concurrency or --sweep")
        if not args.time_scale > 0:
            raise BenchError("--time-scale must be > 0")
        return [LoadSpec("trace", time_scale=args.time_scale)]
    if args.request_rate is not None and (args.concurrency is not None or args.sweep):
        raise BenchError("--request-rate (open loop) excludes --concurrency and --sweep (closed loop)")
    if args.sweep and args.concurrency is not None:
        raise BenchError("give --sweep or --concurrency, not both")
    if args.request_rate is not None:
        if not args.request_rate > 0:
            raise BenchError("--request-rate must be > 0 (inf: all at once)")
        return [LoadSpec("poisson", rate=args.request_rate, seed=args.seed)]
    levels = args.sweep or [args.concurrency if args.concurrency is not None else 8]
    if any(c < 1 for c in levels):
        raise BenchError("concurrency must be >= 1")
    return [LoadSpec("closed", concurrency=c) for c in levels]


def workload_from_args(args: argparse.Namespace) -> WorkloadSpec:
    workload = WorkloadSpec(
        name=args.workload, num_requests=args.num_requests, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, num_groups=args.num_groups, prefix_len=args.prefix_len, turns=args.turns,
        history_len=args.history_len, tool_share=args.tool_share, seed=args.seed,
    )
    for name in ("num_requests", "input_len", "output_len", "num_groups", "turns"):
        if getattr(workload, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be >= 1")
    if workload.history_len < 0:
        raise BenchError("--history-len must be >= 0")
    if not 0 <= workload.range_ratio < 1:
        raise BenchError("--range-ratio must be in [0, 1)")
    if not 0 <= workload.tool_share <= 1:
        raise BenchError("--tool-share must be in [0, 1]")
    return workload


def config_from_args(args: argparse.Namespace, url: str) -> ServeBenchConfig:
    workload = workload_from_args(args)
    if args.timeout <= 0 or math.isnan(args.timeout):
        raise BenchError("--timeout must be > 0")
    if not isinstance(args.extra_body, dict):
        raise BenchError("--extra-body must be a JSON object")
    return ServeBenchConfig(
        url=url, workload=workload, loads=loads_from_args(args), model=args.model, tokenizer=args.tokenizer,
        temperature=args.temperature, ignore_eos=args.ignore_eos, timeout=args.timeout, warmup=args.warmup,
        percentiles=args.percentiles, slos=SLOs(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms),
        api_key=args.api_key, extra_body=args.extra_body, progress=not args.no_progress, keep_alive=args.keep_alive,
        trace=args.trace,
    )


def _fmt(d: dict[str, float] | None, keys: list[str]) -> str:
    return "-" if not d else " / ".join(f"{d[k]:.1f}" for k in keys)


def print_summary(report: dict[str, Any], out: Any = None) -> None:
    out = out or sys.stderr
    keys = [f"p{p:g}" for p in report["percentiles"]]
    print(f"{report['model']} at {report['url']}: {report['workload']['name']}, "
          f"{report['workload']['requests']} requests", file=out)
    for run in report["runs"]:
        s = run["summary"]
        load = run["load"]
        if load["mode"] == "closed":
            what = f"concurrency {load['concurrency']}"
        else:
            rate = load["request_rate"]
            what = "all at once" if rate is None else f"Poisson {rate:g} req/s (seed {load['seed']})"
        print(f"  {what}: {s['completed']}/{s['num_requests']} ok in {s['duration_s']:.1f} s, "
              f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s "
              f"(tokens per request {s['mean_output_tokens']:.1f}, match={s['output_tokens_match']}, "
              f"from {s['token_count_source']})", file=out)
        for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL "), ("e2e_ms", "E2E ")):
            print(f"    {name} ms {'/'.join(keys)}: {_fmt(s[key], keys)}", file=out)
        if "goodput" in s:
            g = s["goodput"]
            print(f"    goodput: {g['requests_meeting']} requests ({100 * g['fraction']:.0f}%), "
                  f"{g['rate']:.2f} req/s", file=out)
        if s["errors"]:
            print(f"    errors: {s['errors']}", file=out)


def run_serve_bench(args: argparse.Namespace) -> int:
    try:
        report = run_benchmark(config_from_args(args, args.url))
    except BenchError as e:
        print(f"kvyard bench serve: error: {e}", file=sys.stderr)
        return 2
    print_summary(report)
    text = json.dumps(report, indent=2)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    else:
        print(json.dumps({k: v for k, v in report.items() if k != "runs"}
                         | {"runs": [{"load": r["load"], "summary": r["summary"]} for r in report["runs"]]},
                         indent=2))
    if args.plot_out:
        from kvyard.bench.plot import plot_report

        plot_report(report, args.plot_out)
    failed = sum(r["summary"]["failed"] for r in report["runs"])
    return 1 if failed else 0
