"""Scoring through the API: a candidate identical to the primary scores KL below 1e-6 (fp32) and the same text;
a degraded one (int4 weights) is flagged. The requests and the primary's tokens come from its capture."""

import asyncio

import httpx
import pytest

from kvyard.server.async_engine import AsyncEngine
from kvyard.shadow.compare import Answer, Budgets, score_pair, verdict
from kvyard.shadow.score import score_tokens
from tests.server.conftest import tiny_engine_config
from tests.server.harness import running_server
from tests.shadow.test_capture import _records

PROMPTS = ["The quick brown fox", "Paged attention keeps the KV cache", "def add(a, b):"]


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    made = {name: AsyncEngine.from_config(tiny_engine_config(path, **options)) for name, options in
            {"primary": {}, "same": {}, "int4": {"quantization": "int4-g32"}}.items()}
    yield made
    for engine in made.values():
        engine.shutdown()


async def _scores(primary_url: str, candidate_url: str, records: list[dict]) -> list:
    async with httpx.AsyncClient(base_url=primary_url, timeout=60) as p, \
            httpx.AsyncClient(base_url=candidate_url, timeout=60) as c:
        scores = []
        for i, r in enumerate(records):
            ids, out = r["prompt_token_ids"], r["output_token_ids"]
            theirs = await c.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": len(out),
                                                           "temperature": 0, "ignore_eos": True})
            primary = Answer(r["output"], dists=await score_tokens(p, primary_url, "tiny", ids, out))
            candidate = Answer(theirs.json()["choices"][0]["text"], dists=await score_tokens(c, candidate_url, "tiny", ids, out))
            scores.append(score_pair(f"r{i}", primary, candidate))
        return scores


def test_an_identical_candidate_agrees_and_a_degraded_one_is_flagged(engines, tmp_path):
    with running_server(engines["primary"], served_model_name="tiny", capture=str(tmp_path)) as primary:
        for prompt in PROMPTS:
            r = httpx.post(primary.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200
        primary.ctx.capture.flush()
        records = _records(tmp_path)
        with running_server(engines["same"], served_model_name="tiny") as same, \
                running_server(engines["int4"], served_model_name="tiny") as int4:
            identical = verdict(asyncio.run(_scores(primary.url, same.url, records)), Budgets(ttft_delta_s=60))
            degraded = verdict(asyncio.run(_scores(primary.url, int4.url, records)), Budgets(ttft_delta_s=60))
    assert identical.passed, identical.failures
    assert identical.summary["kl_mean"] < 1e-6 and identical.summary["exact_match"] == 1.0
    # int4: different text at temperature 0, and a KL far above the identical candidate's
    assert not degraded.passed and degraded.summary["exact_match"] < 1 and degraded.summary["kl_mean"] > 1e-5
    assert degraded.worst[0].kl_mean == max(s.kl_mean for s in degraded.worst)
