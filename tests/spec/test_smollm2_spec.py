"""The real default model: n-gram speculation gives exactly the tokens of plain greedy decoding (fp32)."""

import pytest

from kvyard import LLM, SamplingParams

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
