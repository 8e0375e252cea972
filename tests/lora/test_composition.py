"""Adapters with the rest of the engine: speculative decoding stays lossless (the drafter knows no adapter),
structured output holds, and over int8 base weights an adapter still moves the logits as it does in full
precision."""

import re

import pytest
import torch

from kvyard import LLM, SamplingParams
from kvyard.structured.spec import StructuredOutput
from tests.lora.adapters import make_adapter

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# Repetitive prompts, so that prompt lookup has drafts to propose
PROMPTS = ["a b c d a b c d a b c d a b", "one two three one two three one two", "x y x y x y x y x"]


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    base = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("composition")
    return base, {"a": str(make_adapter(base, root / "a", seed=3)),
                  "b": str(make_adapter(base, root / "b", seed=4, r=8, target_modules=["o_proj", "down_proj"]))}


def test_speculation_with_adapters_is_lossless(adapters):
    base, paths = adapters
    plain = LLM(str(base), dtype="float32", lora_adapters=paths)
    spec = LLM(str(base), dtype="float32", lora_adapters=paths, speculative_method="ngram")
    names = ["a", "b", None]
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY, lora=names)]
    got = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, GREEDY, lora=names)]
    assert got == want
    assert spec.engine.spec.stats.proposed_tokens > 0  # drafts were verified through the adapters


def test_structured_output_holds_with_an_adapter(adapters):
    base, paths = adapters
    llm = LLM(str(base), dtype="float32", lora_adapters=paths)
    pattern = r"(yes|no)( (yes|no)){3}\."
    params = SamplingParams(max_tokens=16, temperature=0.0, structured_output=StructuredOutput.regex(pattern))
    for name in ("a", "b"):
        assert re.fullmatch(pattern, llm.generate(["Answer:"], params, lora=name)[0].outputs[0].text)


def test_an_adapter_over_int8_weights_moves_the_logits_as_in_full_precision(adapters):
    base, paths = adapters
    prompt = list(range(5, 40))
    full = LLM(str(base), dtype="float32", lora_adapters=paths)
    low = LLM(str(base), dtype="float32", quantization="int8", lora_adapters=paths)
    for name in ("a", "b"):
        want = full.engine.compute_logits(prompt, lora=name) - full.engine.compute_logits(prompt)
        got = low.engine.compute_logits(prompt, lora=name) - low.engine.compute_logits(prompt)
        assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.98
