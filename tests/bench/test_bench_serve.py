"""`kvyard bench serve` against a real kvyard server on loopback, serving the tiny random checkpoint."""

import argparse
import asyncio
import json
import math
import socket
import sys

import httpx
import pytest

from kvyard.bench.compare_serve import headline, parse_systems, summarize_rounds
from kvyard.bench.serve import config_from_args, loads_from_args
from kvyard.bench.serve_client import stream_request
from kvyard.bench.serve_load import LoadSpec
from kvyard.bench.serve_metrics import SLOs, percentile
from kvyard.bench.serve_run import (
    BenchError,
    ServeBenchConfig,
    check_loopback,
    run_benchmark,
    sessions_for_load,
)
from kvyard.bench.serve_workloads import WorkloadSpec, build_sessions
from kvyard.cli.main import build_parser, main
from kvyard.server.async_engine import AsyncEngine
from tests.server.conftest import tiny_engine_config
from tests.server.harness import running_server
from tests.tiny import make_tiny_checkpoint

METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    # The tool-call workload puts every tool's JSON schema in the prompt (SmolLM2-style fallback
    # rendering), which the tiny tokenizer spells out in ~800 tokens: give the model room for it.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("bench-serve"), "llama", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def server(tiny_path):
    engine = AsyncEngine.from_config(tiny_engine_config(tiny_path))
    try:
        with running_server(engine) as srv:
            yield srv
    finally:
        engine.shutdown()


def bench(url: str, workload: WorkloadSpec, load: LoadSpec, **options) -> dict:
    cfg = ServeBenchConfig(url=url, workload=workload, loads=[load], progress=False, **options)
    return run_benchmark(cfg)


def check_summary(s: dict, n: int, output_len: int | None) -> None:
    assert s["num_requests"] == n and s["completed"] == n and s["failed"] == 0 and s["errors"] == {}
    assert s["token_count_source"] == {"usage": n} and s["finish_reasons"] == {"length": n}
    assert s["output_tokens_match"] is True  # ignore_eos: every request produced max_tokens
    if output_len is not None:
        assert s["total_output_tokens"] == n * output_len
    assert s["duration_s"] > 0
    assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / s["duration_s"])
    assert s["request_throughput"] == pytest.approx(n / s["duration_s"])
    for key in METRICS:
        d = s[key]
        assert 0 <= d["min"] <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"], (key, d)
        assert d["min"] <= d["mean"] <= d["max"]
    # A request's first token comes before its last.
    assert s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"]


def test_closed_loop_random_with_the_model_tokenizer(server, tiny_path):
    wl = WorkloadSpec("random", num_requests=12, input_len=24, output_len=6, seed=3)
    report = bench(server.url, wl, LoadSpec("closed", concurrency=4), tokenizer=str(tiny_path))
    assert report["benchmark"] == "serve" and report["model"] == str(tiny_path)
    assert report["workload"]["requests"] == 12 and report["workload"]["tokenizer"] == str(tiny_path)
    [run] = report["runs"]
    assert run["load"] == {"mode": "closed", "concurrency": 4}
    s = run["summary"]
    check_summary(s, 12, 6)
    # Prompts made of the model's own tokens come back close to the length asked for (+ BOS).
    assert 12 * 24 * 0.7 <= s["total_input_tokens"] <= 12 * 25
    assert len(run["requests"]) == 12 and all(r["output_tokens"] == 6 for r in run["requests"])
    # each request's longest gap: no more than the worst gap of the run
    assert max(r["itl_max_ms"] for r in run["requests"]) == pytest.approx(s["itl_ms"]["max"], rel=1e-3)
    assert report["percentiles"] == [50.0, 90.0, 99.0]


def test_poisson_open_loop_and_goodput(server):
    wl = WorkloadSpec("random", num_requests=10, input_len=16, output_len=4, range_ratio=0.5, seed=1)
    loose = bench(server.url, wl, LoadSpec("poisson", rate=40.0, seed=7),
                  slos=SLOs(ttft_ms=60_000, tpot_ms=60_000, e2e_ms=60_000))
    [run] = loose["runs"]
    assert run["load"] == {"mode": "poisson", "request_rate": 40.0, "seed": 7}
    s = run["summary"]
    check_summary(s, 10, None)
    assert s["total_output_tokens"] == s["expected_output_tokens"]  # lengths vary with range_ratio
    starts = [r["start_s"] for r in run["requests"]]
    assert starts == sorted(starts) and starts[-1] > 0  # spread over time, not all at once
    assert s["goodput"]["fraction"] == 1.0 and s["goodput"]["requests_meeting"] == 10
    assert s["goodput"]["rate"] == pytest.approx(10 / s["duration_s"])
    strict = bench(server.url, wl, LoadSpec("poisson", rate=math.inf), slos=SLOs(ttft_ms=0.001))
    assert strict["runs"][0]["load"]["request_rate"] is None  # inf: all at once
    assert strict["runs"][0]["summary"]["goodput"]["fraction"] == 0.0


@pytest.mark.parametrize("name", ["shared-prefix", "multi-turn", "tool-call"])
def test_chat_workloads(server, name):
    wl = WorkloadSpec(name, num_requests=7, input_len=12, output_len=5, num_groups=2, prefix_len=40, turns=3)
    report = bench(server.url, wl, LoadSpec("closed", concurrency=1 if name == "multi-turn" else 3))
    [run] = report["runs"]
    check_summary(run["summary"], 7, 5)
    prompts = [r["prompt_tokens"] for r in run["requests"]]
    if name == "multi-turn":
        assert report["workload"]["sessions"] == 3  # 3 + 3 + 1 turns
        # One conversation at a time: each turn resends the growing history.
        assert prompts[0] < prompts[1] < prompts[2] and prompts[3] < prompts[4] < prompts[5]
    if name == "shared-prefix":
        assert min(prompts) > 40  # the system prompt is in every request


def test_cli_sweep_writes_json_and_png(server, tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["bench", "serve", "--url", server.url + "/v1", "--num-requests", "6", "--input-len", "8",
               "--output-len", "3", "--sweep", "1,4", "--no-progress", "--json-out", str(out), "--plot-out", str(png)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert [r["load"]["concurrency"] for r in report["runs"]] == [1, 4]
    for run in report["runs"]:
        check_summary(run["summary"], 6, 3)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "concurrency 4" in capsys.readouterr().err


def test_timeouts_are_counted_and_the_run_ends(server):
    wl = WorkloadSpec("random", num_requests=4, input_len=8, output_len=200)
    report = bench(server.url, wl, LoadSpec("closed", concurrency=4), timeout=0.02, warmup=0)
    s = report["runs"][0]["summary"]
    assert s["failed"] == 4 and s["completed"] == 0 and s["output_tokens_match"] is False
    assert list(s["errors"]) == ["timeout after 0.02 s"]
    assert s["ttft_ms"] is None


def test_server_errors_are_counted(server):
    wl = WorkloadSpec("random", num_requests=3, input_len=8, output_len=3)
    report = bench(server.url, wl, LoadSpec("closed", concurrency=2), model="no-such-model", warmup=0)
    s = report["runs"][0]["summary"]
    assert s["failed"] == 3 and next(iter(s["errors"])).startswith("HTTP 404")


def test_unreachable_and_remote_urls_are_refused():
    wl = WorkloadSpec("random", num_requests=1)
    with pytest.raises(BenchError, match="cannot talk"):
        bench("http://127.0.0.1:9", wl, LoadSpec(), timeout=2)
    with pytest.raises(BenchError, match="this machine"):
        check_loopback("http://example.com:8000")
    assert check_loopback("http://localhost:8000/v1/") == "http://localhost:8000"
    assert check_loopback("http://[::1]:8000") == "http://[::1]:8000"


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "serve", "--url", "http://127.0.0.1:1", *argv])


def test_load_flags():
    assert loads_from_args(_args()) == [LoadSpec("closed", concurrency=8)]
    assert loads_from_args(_args("--request-rate", "2.5", "--seed", "4")) == [LoadSpec("poisson", rate=2.5, seed=4)]
    assert [x.concurrency for x in loads_from_args(_args("--sweep", "1,4,16"))] == [1, 4, 16]
    for bad in (["--request-rate", "2", "--concurrency", "4"], ["--sweep", "1,2", "--concurrency", "4"],
                ["--request-rate", "0"], ["--concurrency", "0"]):
        with pytest.raises(BenchError):
            loads_from_args(_args(*bad))
    with pytest.raises(BenchError):
        config_from_args(_args("--range-ratio", "1.5"), "http://127.0.0.1:1")
    cfg = config_from_args(_args("--extra-body", '{"top_k": 1}', "--slo-ttft-ms", "50"), "http://127.0.0.1:1")
    assert cfg.extra_body == {"top_k": 1} and cfg.slos.given() == {"ttft_ms": 50.0}


def test_workload_shapes():
    for name in ("random", "shared-prefix", "multi-turn", "tool-call"):
        sessions = build_sessions(WorkloadSpec(name, num_requests=10, turns=4, num_groups=3, prefix_len=20))
        assert sum(len(s.turns) for s in sessions) == 10
    shared = build_sessions(WorkloadSpec("shared-prefix", num_requests=9, num_groups=3, prefix_len=20))
    assert len({s.system for s in shared}) == 3 and all(len(s.system.split()) == 20 for s in shared)
    chats = build_sessions(WorkloadSpec("multi-turn", num_requests=6, turns=3, history_len=30))
    assert len({s.system for s in chats}) == 2 and all(len(s.system.split()) == 30 for s in chats)
    assert all(s.system is None for s in build_sessions(WorkloadSpec("multi-turn", num_requests=6, turns=3)))
    again = build_sessions(WorkloadSpec("random", num_requests=3, seed=5))
    assert [s.turns[0].content for s in again] == [s.turns[0].content for s in build_sessions(
        WorkloadSpec("random", num_requests=3, seed=5))]


def test_percentile_matches_numpy():
    import numpy as np

    values = sorted([3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0])
    for p in (0, 50, 90, 99, 100):
        assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)))


def test_every_load_and_the_warm_up_get_fresh_prompts():
    cfg = ServeBenchConfig(url="http://127.0.0.1:1", workload=WorkloadSpec("random", num_requests=4, seed=3),
                           loads=[])
    prompts = [[t.content for sess in sessions_for_load(cfg, None, i) for t in sess.turns] for i in (-1, 0, 1)]
    assert len({p for load in prompts for p in load}) == 12  # no prompt repeats across the three
    assert prompts[1] == [s.turns[0].content for s in build_sessions(WorkloadSpec("random", num_requests=4, seed=3))]


def test_compare_summary():
    with pytest.raises(BenchError):
        parse_systems(["a=serve --port 1"])  # no {port}
    with pytest.raises(BenchError):
        parse_systems(["a=x {port}"])  # only one system
    systems = parse_systems(["a=x {port}", "b=y {port}"])
    summary = {"output_throughput": 0.0, "request_throughput": 1.0, "mean_output_tokens": 4.0, "completed": 4,
               "failed": 0, "output_tokens_match": True, "token_count_source": {"usage": 4},
               **{k: {"p50": 1.0, "p99": 2.0} for k in METRICS}}
    rows = {"a": [headline(summary | {"output_throughput": t}, [50, 99]) | {"round": i + 1}
                  for i, t in enumerate((30.0, 20.0))],
            "b": [headline(summary | {"output_throughput": t}, [50, 99]) | {"round": i + 1}
                  for i, t in enumerate((10.0, 20.0))]}
    result = summarize_rounds(systems, rows, {"mode": "closed", "concurrency": 2})
    assert result["median"]["a"]["output_throughput"] == 25.0
    assert result["ratios"]["a/b"]["output_throughput_of_medians"] == pytest.approx(25 / 15)
    assert result["ratios"]["a/b"]["output_throughput_per_round"] == [3.0, 1.0]
    assert result["median"]["a"]["ttft_p99_ms"] == 2.0


def test_serve_compare_starts_and_stops_each_server(tiny_path, tmp_path):
    """Two kvyard servers (the same command), one round: each is started, benchmarked and stopped in turn."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = (f"{sys.executable} -m kvyard.cli.main serve --model {tiny_path} --dtype float32 --kv-cache-memory 4MiB "
           "--num-threads 1 --port {port} --log-level warning")
    out = tmp_path / "cmp"
    rc = main(["bench", "serve-compare", "--system", f"a={cmd}", "--system", f"b={cmd}", "--rounds", "1",
               "--port", str(port), "--num-requests", "4", "--input-len", "8", "--output-len", "3",
               "--sweep", "1,2", "--no-progress", "--out-dir", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert [entry["load"] for entry in report["loads"]] == [{"mode": "closed", "concurrency": c} for c in (1, 2)]
    for entry in report["loads"]:
        for name in ("a", "b"):
            assert entry["median"][name]["completed"] == 4 and entry["median"][name]["output_tokens_match"] is True
        assert len(entry["ratios"]["a/b"]["output_throughput_per_round"]) == 1
    for name in ("a", "b"):
        assert (out / f"{name}-round1.json").exists() and (out / f"{name}-round1.log").exists()
        assert json.loads((out / f"{name}-round1.json").read_text())["request"]["keep_alive"] is False
    with pytest.raises(OSError):  # both servers are gone
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def _fake_stream(events: list[str], status: int = 200):
    """A client whose server answers every POST with these SSE lines (llama.cpp style: no usage)."""
    body = "".join(f"{e}\n\n" for e in events).encode()
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
    return httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:1")


async def _one(events: list[str], status: int = 200):
    async with _fake_stream(events, status) as client:
        return await stream_request(client, "/v1/completions", {}, 5.0, 0.0, 3)


def test_stream_parsing_without_usage_errors_and_truncation():
    chunk = 'data: {"choices": [{"text": "%s", "index": 0, "finish_reason": null}]}'
    res = asyncio.run(_one([": ping", chunk % "a", chunk % "", chunk % "b", chunk % "c", "data: [DONE]"]))
    assert res.ok and res.output_tokens == 3 and res.token_source == "chunks" and res.text == "abc"
    assert len(res.itls) == 2 and res.prompt_tokens is None
    chat = 'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}}]}'
    res = asyncio.run(_one([chat, 'data: {"choices": [], "usage": {"completion_tokens": 9, "prompt_tokens": 4}}',
                            "data: [DONE]"]))
    assert res.ok and res.text == "f{}" and res.output_tokens == 9 and res.token_source == "usage" and res.prompt_tokens == 4
    # No usage, but finish_reason "length": max_tokens were generated, even if two came in one chunk.
    last = 'data: {"choices": [{"text": "", "index": 0, "finish_reason": "length"}]}'
    res = asyncio.run(_one([chunk % "a", chunk % "\u00e9", last, "data: [DONE]"]))
    assert res.ok and res.chunks == 2 and res.output_tokens == 3 and res.token_source == "finish_length"
    assert res.finish_reason == "length"
    res = asyncio.run(_one([chunk % "a", 'data: {"error": {"message": "boom"}}', "data: [DONE]"]))
    assert not res.ok and "boom" in res.error
    res = asyncio.run(_one([chunk % "a"]))
    assert not res.ok and res.error == "the stream ended without [DONE]"
    res = asyncio.run(_one(['{"detail": "no"}'], status=500))
    assert not res.ok and res.error.startswith("HTTP 500")
