"""A tensor-parallel replica behind the real HTTP server, through the openai client: one worker to its clients,
the single process's text, and a rank killed mid-stream costs that stream only."""

import time

import httpx
import openai
import pytest

from kvyard.config import EngineConfig
from kvyard.server.async_engine import AsyncEngine
from tests.server.harness import running_server
from tests.spec.test_serve_spec import served_completions


def test_two_ranks_serve_the_single_process_text(tiny_checkpoint):
    # Served engines calibrate their step cost first: rank 0's calibration steps go to rank 1 like any other
    path = tiny_checkpoint("llama")
    assert served_completions(path, tensor_parallel_size=2)[0] == served_completions(path)[0]


def test_a_rank_killed_mid_stream_costs_that_stream_only(tiny_checkpoint):
    cfg = EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", kv_cache_memory="4MiB",
                       max_num_batched_tokens=64, num_threads=2, tensor_parallel_size=2)
    engine = AsyncEngine.from_config(cfg)
    try:
        with running_server(engine, served_model_name="tiny") as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            ask = dict(model="tiny", prompt="The quick brown fox", max_tokens=40, temperature=0.0,
                       extra_body={"ignore_eos": True})
            want = client.completions.create(**ask).choices[0].text
            worker = engine._engine._workers.processes[0]
            chunks = 0
            with pytest.raises(openai.APIError, match="generation failed"):  # the stream's error event
                for chunks, _ in enumerate(client.completions.create(stream=True, **ask), 1):
                    if chunks == 3:
                        worker.kill()
            assert chunks >= 3
            deadline = time.monotonic() + 60  # the gang restarts; /health is 503 meanwhile, then 200
            while httpx.get(srv.url + "/health", timeout=5).status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert client.completions.create(**ask).choices[0].text == want
            assert engine.stats().rank_restarts == 1
            assert "kvyard_rank_restarts_total 1.0" in httpx.get(srv.url + "/metrics", timeout=5).text
    finally:
        engine.shutdown()
