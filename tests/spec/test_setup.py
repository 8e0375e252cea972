"""Configuration, the draft model's tokenizer check, and the exported metrics."""

import argparse
import asyncio
import json
import shutil

import pytest

from kvyard import LLM, SamplingParams
from kvyard.cli.engine_args import add_engine_args, engine_config_from_args
from kvyard.config import EngineConfig
from kvyard.errors import InvalidRequestError, TokenizerMismatchError
from kvyard.server.async_engine import AsyncEngine, EngineStats
from kvyard.server.metrics import ServerMetrics


def test_cli_flags_reach_the_engine_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        [
            "--speculative-method",
            "ngram",
            "--num-speculative-tokens",
            "3",
            "--no-speculative-adaptive",
            "--ngram-max",
            "5",
        ]
    )
    cfg = engine_config_from_args(args)
    assert (cfg.speculative_method, cfg.num_speculative_tokens, cfg.speculative_adaptive, cfg.ngram_max) == (
        "ngram",
        3,
        False,
        5,
    )
    assert EngineConfig(speculative_model="some/draft").speculative_method == "draft"


@pytest.mark.parametrize(
    "bad",
    [
        dict(speculative_method="eagle"),
        dict(speculative_method="draft"),
        dict(speculative_method="ngram", num_speculative_tokens=0),
    ],
)
def test_bad_speculative_settings_are_refused(bad):
    with pytest.raises(InvalidRequestError):
        EngineConfig(**bad)


def test_a_draft_with_another_tokenizer_is_refused(target_path, tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(target_path, draft)
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same size, other meaning
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(TokenizerMismatchError, match="vocabularies differ in 2 tokens"):
        LLM(str(target_path), dtype="float32", speculative_model=str(draft))


def test_spec_counters_are_exported():
    stats = EngineStats(
        num_steps=10,
        spec_proposed_tokens=40,
        spec_accepted_tokens=25,
        spec_verify_steps=10,
        spec_emitted_tokens=35,
        spec_drafter_seconds=0.5,
    )
    text = ServerMetrics(lambda: stats).render()[0].decode()
    for line in (
        "kvyard_spec_proposed_tokens_total 40.0",
        "kvyard_spec_accepted_tokens_total 25.0",
        "kvyard_spec_verify_steps_total 10.0",
        "kvyard_spec_emitted_tokens_total 35.0",
        "kvyard_spec_drafter_seconds_total 0.5",
        "kvyard_num_steps_total 10.0",
    ):
        assert line in text


def test_engine_stats_snapshot_carries_spec_counters(target_path):
    eng = AsyncEngine.from_config(
        EngineConfig(
            model=str(target_path), dtype="float32", kv_cache_memory="8MiB", speculative_method="ngram"
        )
    )

    async def run() -> list[int]:
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        outs = [
            o async for o in eng.generate("The quick brown fox jumps over the lazy dog. The quick", params)
        ]
        return outs[-1].outputs[0].token_ids

    try:
        assert len(asyncio.run(run())) == 20
        # A snapshot follows every step; the steps before the last one already verified drafts.
        s = eng.stats()
        assert s.spec_proposed_tokens > 0 and s.spec_verify_steps > 0 and s.spec_drafter_seconds > 0
    finally:
        eng.shutdown()
