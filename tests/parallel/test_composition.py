"""What the engine already does keeps working on parallel replicas: the prefix cache, chunked prefill,
speculative decoding (prompt lookup), structured output and low-bit weights give the single process's tokens
(with the same settings) on tensor-parallel ranks and on pipeline stages."""

import re

import pytest

from kvyard import LLM, SamplingParams
from kvyard.structured.spec import StructuredOutput
from tests.parallel.test_tensor_parallel import LOGIT_ATOL, PROMPTS

LAYOUTS = {"tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}
# a prompt that repeats itself (prompt lookup finds drafts) and is longer than a step's token budget
REPEATING = "one two three four five six seven eight nine ten " * 6
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PATTERN = r"[0-9]{3}-[a-z]{2}"
DIGITS = SamplingParams(max_tokens=8, temperature=0.0, structured_output=StructuredOutput.regex(PATTERN))


def _answers(llm: LLM) -> list[list[int]]:
    """Twice the same prompts (the second time from the prefix cache), and a constrained one."""
    runs = [llm.generate([REPEATING, *PROMPTS], GREEDY) for _ in range(2)]
    constrained = llm.generate(PROMPTS[:1], DIGITS)
    return [o.outputs[0].token_ids for run in [*runs, constrained] for o in run]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_prefix_cache_chunks_speculation_and_grammars_on_parallel_replicas(tiny_checkpoint, layout):
    path = str(tiny_checkpoint("llama"))
    settings = dict(dtype="float32", enable_prefix_caching=True, enable_chunked_prefill=True,
                    max_num_batched_tokens=32, speculative_method="ngram", num_speculative_tokens=3)
    with LLM(path, **settings) as single:
        want = _answers(single)
    with LLM(path, **settings, **LAYOUTS[layout]) as llm:
        assert _answers(llm) == want
        assert llm.engine.blocks.hit_tokens > 0  # the second run's prompts came from the cache
        assert llm.engine.spec.stats.accepted_tokens > 0  # drafts were verified and taken
    assert re.fullmatch(PATTERN, llm.tokenizer.decode(want[-1], skip_special_tokens=True))  # the grammar held


@pytest.mark.parametrize("scheme", ["int8", "int4-g32"])
def test_low_bit_weights_on_two_ranks(tiny_checkpoint, scheme):
    """Each rank holds its slice of the same codes and scales (row-parallel weights cut on group boundaries)."""
    path = str(tiny_checkpoint("llama"))
    with LLM(path, dtype="float32", quantization=scheme) as single:
        want = [o.outputs[0].token_ids for o in single.generate(PROMPTS, GREEDY)]
        want_logits = [single.engine.compute_logits(single.tokenizer(p).input_ids) for p in PROMPTS]
    with LLM(path, dtype="float32", quantization=scheme, tensor_parallel_size=2) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        for prompt, theirs in zip(PROMPTS, want_logits, strict=True):
            ours = llm.engine.compute_logits(llm.tokenizer(prompt).input_ids)
            assert (ours - theirs).abs().max().item() <= LOGIT_ATOL
        o_proj = llm.engine.runner.model.layers[0].o
        assert type(o_proj).__name__ != "Tensor"  # low-bit on the rank too


def test_low_bit_groups_that_a_rank_share_would_cut_are_refused_by_name(tiny_checkpoint):
    """The tiny model's down_proj has 128 input columns: two ranks' shares of 64 cut its one group of 128."""
    from kvyard.errors import ConfigError
    from kvyard.parallel.comm import current_group

    with pytest.raises(ConfigError, match=r"down_proj\.weight: columns 0\.\.64 do not fall on the "
                       r"weight's groups of 128; tensor_parallel_size 2 cannot split this low-bit checkpoint"):
        LLM(str(tiny_checkpoint("llama")), dtype="float32", quantization="int4-g128", tensor_parallel_size=2)
    assert current_group() is None  # the ranks it started are stopped
