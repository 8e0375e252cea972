"""Traffic capture: sampled requests as JSON lines (Mooncake's fields, OpenTelemetry GenAI names, kvyard's own),
written off the serving path; bounded, rotated, redactable."""

import json
import threading

import httpx
import pytest
from openai import OpenAI

from kvyard.errors import ConfigError
from kvyard.sampling_params import SamplingParams
from kvyard.server.async_engine import AsyncEngine
from kvyard.shadow.capture import HASH_BLOCK, CaptureSettings, Observed, TraceCapture
from tests.server.conftest import tiny_engine_config
from tests.server.harness import running_server

WORDS = "paged attention keeps the cache in blocks"


def _records(directory) -> list[dict]:
    return [json.loads(line) for f in sorted(directory.glob("capture-*.jsonl")) for line in f.read_text().splitlines()]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    engine = AsyncEngine.from_config(tiny_engine_config(tiny_checkpoint("llama")))
    yield engine
    engine.shutdown()


def _serve_and_capture(engine, directory, **capture) -> tuple[list[dict], list[str]]:
    with running_server(engine, served_model_name="tiny", capture={"dir": str(directory), **capture}) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        texts = [client.completions.create(model="tiny", prompt=WORDS, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].text]
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": WORDS}],
                                                max_tokens=5, temperature=0, stream=True)
        texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
        srv.ctx.capture.flush()
        return _records(directory), texts


def test_each_request_becomes_a_record_with_what_a_replay_needs(engine, tmp_path):
    records, texts = _serve_and_capture(engine, tmp_path / "cap")
    assert len(records) == 2
    for record, text in zip(records, texts, strict=True):
        assert record["output"] == text and record["output_length"] == len(record["output_token_ids"])
        assert record["input_length"] == len(record["prompt_token_ids"]) == record["gen_ai.usage.input_tokens"]
        assert WORDS in record["prompt"]
        assert record["gen_ai.request.model"] == "tiny" and record["gen_ai.request.temperature"] == 0
        assert record["params"]["max_tokens"] in (5, 6) and record["gen_ai.response.finish_reasons"] == ["length"]
        assert 0 < record["ttft_s"] < 60 and len(record["itl_s"]) == record["output_length"] - 1
        assert len(record["config_fingerprint"]) == 16
    assert records[0]["timestamp"] <= records[1]["timestamp"]
    # the completion's prompt and the chat's templated one share no 512-token block: different ids
    assert records[0]["hash_ids"] == [0] and records[1]["hash_ids"] == [1]


def test_redaction_keeps_counts_and_hashes_but_no_text_or_ids(engine, tmp_path):
    records, _ = _serve_and_capture(engine, tmp_path / "red", redact=True)
    raw = "".join(f.read_text() for f in (tmp_path / "red").glob("*.jsonl"))
    assert "paged" not in raw and "attention" not in raw
    assert all("prompt_token_ids" not in r and "output" not in r and r["input_length"] > 0 for r in records)


def test_sampling_nothing_writes_nothing(engine, tmp_path):
    records, _ = _serve_and_capture(engine, tmp_path / "none", sample=0.0)
    assert records == []


def _observed(n_prompt: int = 8) -> Observed:
    return Observed(0.0, list(range(n_prompt)), SamplingParams(max_tokens=2), [1, 2], "ab", "length", [1.0, 1.5], [1, 1], 0.5)


def test_a_full_queue_drops_and_counts_and_never_blocks(tmp_path):
    capture = TraceCapture(CaptureSettings(dir=str(tmp_path), queue=2), "m", "r", "f", lambda ids: "x")
    gate = threading.Event()
    capture.record = lambda seen: (gate.wait(10), {"a": 1})[1]  # the writer stuck on its first record
    for _ in range(10):
        capture.submit(_observed())  # returns at once every time
    assert capture.dropped >= 7
    gate.set()
    capture.close()
    assert capture.records + capture.dropped == 10


def test_files_rotate_and_the_oldest_go_past_the_budget(tmp_path):
    capture = TraceCapture(CaptureSettings(dir=str(tmp_path), file_bytes="2KiB", max_bytes="6KiB"), "m", "r", "f",
                           lambda ids: "y" * 300)
    for _ in range(60):
        capture.submit(_observed())
    capture.close()
    files = sorted(tmp_path.glob("capture-*.jsonl"))
    assert len(files) >= 3 and sum(f.stat().st_size for f in files) <= 6 * 1024
    assert all(f.stat().st_size <= 2 * 1024 for f in files) and files[0].name != "capture-000001.jsonl"


def test_shared_prefixes_share_hash_ids(tmp_path):
    capture = TraceCapture(CaptureSettings(dir=str(tmp_path)), "m", "r", "f", str)
    long = list(range(2 * HASH_BLOCK + 5))
    assert capture._hash_ids(long) == [0, 1, 2]
    assert capture._hash_ids(long[:HASH_BLOCK] + [7] * HASH_BLOCK) == [0, 3]
    capture.close()


def test_bad_settings_are_named():
    with pytest.raises(ConfigError, match="sample"):
        CaptureSettings(dir="x", sample=1.5)
    with pytest.raises(ConfigError, match="unknown key 'rate'"):
        from kvyard.server.config import ServerSettings

        ServerSettings(capture={"dir": "x", "rate": 0.5})


def test_a_capture_that_cannot_be_written_loses_records_not_requests(engine, tmp_path):
    directory = tmp_path / "gone"
    with running_server(engine, served_model_name="tiny", capture=str(directory)) as srv:
        directory.rmdir()
        directory.write_text("a file where the directory was")  # every write now fails
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": WORDS, "max_tokens": 3, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        srv.ctx.capture.flush()
        assert srv.ctx.capture.dropped == 1 and srv.ctx.capture.records == 0
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        assert "kvyard_capture_dropped_total 1.0" in metrics and "kvyard_capture_records_total 0.0" in metrics
