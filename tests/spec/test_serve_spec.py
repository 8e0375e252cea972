"""Each drafter behind the real HTTP server, through the openai client: the same greedy text as without."""

import openai
import pytest

from kvyard.config import EngineConfig
from kvyard.server.async_engine import AsyncEngine
from tests.server.harness import running_server

PROMPTS = ["the cat sat on the mat and the cat sat on the", "one two three one two three one two"]


def served_completions(path, **spec) -> tuple[list[str], int]:
    cfg = EngineConfig(model=str(path), dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=64,
                       num_threads=2, **spec)
    engine = AsyncEngine.from_config(cfg)
    try:
        with running_server(engine, served_model_name="tiny") as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            texts = []
            for prompt in PROMPTS:
                r = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0.0,
                                              extra_body={"ignore_eos": True})
                assert r.usage.completion_tokens == 16
                texts.append(r.choices[0].text)
            stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}],
                                                    max_tokens=12, temperature=0.0, stream=True,
                                                    extra_body={"ignore_eos": True})
            texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
            return texts, engine.stats().spec_verify_steps
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def plain(target_path):
    return served_completions(target_path)[0]


@pytest.mark.parametrize("drafter", ["ngram", "draft", "speculator"])
def test_each_drafter_serves_the_plain_greedy_text(drafter, plain, target_path, small_draft_path, speculator_dir):
    spec = {"ngram": {"speculative_method": "ngram"},
            "draft": {"speculative_model": str(small_draft_path)},
            "speculator": {"speculator": str(speculator_dir)}}[drafter]
    texts, verify_steps = served_completions(target_path, **spec)
    assert texts == plain
    assert verify_steps > 0  # the drafter really ran inside the server's engine
