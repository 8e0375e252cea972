"""`kvyard bench serve --trace`: a capture replays to the same prompts at the same arrival pattern; Mooncake and
Azure traces (lengths only) get synthetic text, shared hash ids shared text."""

import json
import time

import httpx
import pytest

from kvyard.bench.serve_load import LoadSpec
from kvyard.bench.serve_run import BenchError, ServeBenchConfig, run_benchmark
from kvyard.bench.serve_workloads import WorkloadSpec
from kvyard.bench.trace import read_trace
from kvyard.server.async_engine import AsyncEngine
from tests.server.conftest import tiny_engine_config
from tests.server.harness import running_server
from tests.shadow.test_capture import _records

GAPS_S = [0.0, 0.4, 0.9]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    engine = AsyncEngine.from_config(tiny_engine_config(tiny_checkpoint("llama")))
    yield engine
    engine.shutdown()


def test_a_capture_replays_to_the_same_prompts_and_arrivals(engine, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    with running_server(engine, served_model_name="tiny", capture=str(first)) as srv:
        start = time.monotonic()
        for i, gap in enumerate(GAPS_S):
            time.sleep(max(0.0, start + gap - time.monotonic()))
            r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": f"request {i}: the quick brown fox", "max_tokens": 4 + i, "temperature": 0})
            assert r.status_code == 200
        srv.ctx.capture.flush()
    captured = _records(first)
    sessions = read_trace(first)
    assert [s.turns[0].content for s in sessions] == [r["prompt_token_ids"] for r in captured]
    assert [s.turns[0].max_tokens for s in sessions] == [r["output_length"] for r in captured]
    with running_server(engine, served_model_name="tiny", capture=str(second)) as srv:
        cfg = ServeBenchConfig(url=srv.url, workload=WorkloadSpec(), loads=[LoadSpec("trace", time_scale=1.0)],
                               trace=str(first), warmup=0, progress=False)
        report = run_benchmark(cfg)
        srv.ctx.capture.flush()
    # (the client counts a stream whose tokens decode to no text as failed: the tiny model's can; the server
    # answered every one, as its capture shows)
    assert report["runs"][0]["summary"]["num_requests"] == len(GAPS_S)
    replayed = _records(second)
    assert [r["prompt_token_ids"] for r in replayed] == [r["prompt_token_ids"] for r in captured]
    assert [r["output_length"] for r in replayed] == [r["output_length"] for r in captured]
    want = [r["timestamp"] - captured[0]["timestamp"] for r in captured]
    got = [r["timestamp"] - replayed[0]["timestamp"] for r in replayed]
    assert all(abs(g - w) < 150 for g, w in zip(got, want, strict=True)), (got, want)  # ms


def test_mooncake_and_azure_traces_get_synthetic_text_of_their_lengths(tmp_path):
    mooncake = tmp_path / "mooncake.jsonl"
    mooncake.write_text("\n".join(json.dumps(r) for r in [
        {"timestamp": 1000, "input_length": 600, "output_length": 10, "hash_ids": [0, 1]},
        {"timestamp": 0, "input_length": 512, "output_length": 5, "hash_ids": [0]},
    ]))
    later, earlier = read_trace(mooncake)[1], read_trace(mooncake)[0]
    assert (earlier.at_s, later.at_s) == (0.0, 1.0)  # sorted by arrival, offsets from the first
    a, b = earlier.turns[0].content, later.turns[0].content
    assert len(a.split()) == 512 and len(b.split()) == 600 and b.startswith(a)  # hash id 0: the same block
    azure = tmp_path / "azure.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                     "2023-11-16 18:15:50.9951690,396,109\n")
    sessions = read_trace(azure)
    assert [round(s.at_s, 2) for s in sessions] == [0.0, 4.31]
    assert [(len(s.turns[0].content.split()), s.turns[0].max_tokens) for s in sessions] == [(374, 44), (396, 109)]


def test_a_file_that_is_no_trace_says_where(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 1, "input_length": 3, "output_length": 2}\nnot json\n')
    cfg = ServeBenchConfig(url="http://127.0.0.1:9", workload=WorkloadSpec(), loads=[LoadSpec("trace")],
                           trace=str(bad), progress=False)
    with pytest.raises(BenchError, match=r"bad\.jsonl:2: not a trace record"):
        run_benchmark(cfg)
