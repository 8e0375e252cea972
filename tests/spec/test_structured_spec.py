"""A drafted token the grammar forbids is rejected: constrained output is unchanged by speculation."""

import re

import pytest

from kvyard import SamplingParams
from kvyard.structured.spec import StructuredOutput
from tests.spec.conftest import spec_llm

PATTERN = r"(fox|dog|cat)( (fox|dog|cat)){6}\."


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_constrained_greedy_output_is_identical(target_path, base_llm, drafter):
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_output=StructuredOutput.regex(PATTERN))
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox"
    want = base_llm.generate(prompt, params)[0].outputs[0]
    # The target drafting for itself proposes its unconstrained argmax, which the grammar mostly forbids.
    opts = {"speculative_method": "ngram"} if drafter == "ngram" else {"speculative_model": str(target_path)}
    llm = spec_llm(target_path, **opts)
    got = llm.generate(prompt, params)[0].outputs[0]
    assert got.token_ids == want.token_ids and re.fullmatch(PATTERN, got.text)
    assert llm.engine.spec.stats.proposed_tokens > 0
