"""The real default model: n-gram and speculator drafting give exactly the tokens of plain greedy decoding (fp32)."""

import pytest
import torch

from kvyard import LLM, SamplingParams
from kvyard.loader.checkpoint import load_checkpoint
from kvyard.spec.speculator.format import (
    EMBED,
    TOKEN_MAP,
    SpeculatorConfig,
    save_speculator,
    target_fingerprint,
)
from kvyard.spec.speculator.model import drafter_hf_config
from kvyard.spec.speculator.train import target_tensors

PROMPTS = [
    "Rewrite this sentence in the passive voice: The cat chased the mouse around the garden.",
    "List the days of the week: Monday, Tuesday,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
]


@pytest.fixture(scope="module")
def smollm2_spec(smollm2_path):
    return LLM(str(smollm2_path), dtype="float32", kv_cache_memory="64MiB", speculative_method="ngram")


def test_smollm2_ngram_greedy_is_identical(smollm2_spec):
    llm = smollm2_spec
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    spec = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    stats = llm.engine.spec.stats
    assert stats.accepted_tokens > 0, stats
    llm.engine.spec = None  # the same engine and weights, speculation off
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert spec == plain


def test_smollm2_speculator_greedy_is_identical(smollm2_path, smollm2_spec, tmp_path):
    """A speculator built from all 30 target layers (so most drafts are right) over a 4096-token draft
    vocabulary: accepted runs, rejections and out-of-vocabulary tokens all occur, and the output is exact."""
    ckpt = load_checkpoint(smollm2_path)
    layers = list(range(ckpt.config.num_layers))
    tensors = target_tensors(ckpt, layers)  # HF names: the drafter's layers are the target's, unchanged
    fingerprint = target_fingerprint(ckpt.hf_config, tensors.pop(EMBED))
    tensors[TOKEN_MAP] = torch.arange(4096)  # byte-level BPE: low ids are the frequent tokens
    cfg = SpeculatorConfig(str(smollm2_path), fingerprint, drafter_hf_config(ckpt.hf_config, len(layers)), layers,
                           4096)
    save_speculator(tmp_path / "spec", cfg, tensors)
    del tensors

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    smollm2_spec.engine.spec = None
    plain = [o.outputs[0].token_ids for o in smollm2_spec.generate(PROMPTS, params)]
    llm = LLM(str(smollm2_path), dtype="float32", kv_cache_memory="64MiB", speculator=str(tmp_path / "spec"))
    spec = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    stats = llm.engine.spec.stats
    assert spec == plain
    assert 0 < stats.accepted_tokens < stats.proposed_tokens, stats
