"""logit_bias in the engine: its place among the logits processors, its checks, and speculation.

The sampler adds the bias after the penalties and before the min_tokens and grammar masks; speculative
verification runs the same processing on every verified position, so a biased greedy request gives the
same tokens with or without drafts, even from a drafter that knows nothing of the bias.
"""

from collections import Counter

import pytest
import torch

from kvyard import LLM, SamplingParams
from kvyard.engine.request import Request
from kvyard.engine.sampler import process_logits
from kvyard.errors import InvalidRequestError

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown", "def add(a, b):\n    return a + b\n"]


def test_bias_comes_after_penalties_and_before_masks():
    r = Request("r", [1], SamplingParams(repetition_penalty=2.0, logit_bias={1: 3.0, 2: -100.0, 0: 50.0},
                                         min_tokens=1), eos_token_ids=(0,))
    logits = torch.tensor([[1.0, 4.0, 2.0, -1.0]])
    process_logits(logits, [r])
    # token 1 (in the prompt): 4 / 2 + 3; token 0 is EOS, masked by min_tokens whatever its bias.
    assert logits[0].tolist() == [float("-inf"), 5.0, -98.0, -1.0]


@pytest.mark.parametrize(("bias", "why"), [({1: 100.5}, "values must be in"), ({1: float("nan")}, "values"),
                                           ({-1: 1.0}, "keys must be token ids"), ({True: 1.0}, "keys"),
                                           ({1: "5"}, "values")])
def test_bad_bias_is_an_invalid_request(bias, why):
    with pytest.raises(InvalidRequestError, match=why) as e:
        SamplingParams(logit_bias=bias)
    assert e.value.param == "logit_bias"


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint("llama")), dtype="float32", max_num_batched_tokens=64)


def test_token_ids_are_checked_against_the_vocabulary(llm):
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(InvalidRequestError, match="vocabulary") as e:
        llm.engine.add_request("hi", SamplingParams(logit_bias={vocab: 1.0}))
    assert e.value.param == "logit_bias"


def test_plus_100_forces_and_minus_100_bans(llm):
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    forced = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True,
                                                   logit_bias={42: 100.0}))
    assert all(o.outputs[0].token_ids == [42] * 8 for o in forced)
    free = [t for o in llm.generate(PROMPTS * 4, sampled) for t in o.outputs[0].token_ids]
    banned = [t for t, _ in Counter(free).most_common(5)]
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, logit_bias=dict.fromkeys(banned, -100.0))
    out = [t for o in llm.generate(PROMPTS * 4, params) for t in o.outputs[0].token_ids]
    assert not set(out) & set(banned)


def test_speculative_verification_applies_the_bias(tiny_checkpoint, llm):
    path = str(tiny_checkpoint("llama"))
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
    # Ban what greedy picks most, nudge another up: the drafter (the unbiased model itself) keeps
    # proposing the old path, which verification must reject where the bias changes the choice.
    common = Counter(t for ids in plain for t in ids).most_common(2)
    biased = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                            logit_bias={common[0][0]: -100.0, common[1][0]: 2.5})
    reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, biased)]
    assert reference != plain and all(common[0][0] not in ids for ids in reference)
    spec = LLM(path, dtype="float32", max_num_batched_tokens=64, speculative_model=path, num_speculative_tokens=3)
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, biased)] == reference
    stats = spec.engine.spec.stats
    assert 0 < stats.accepted_tokens < stats.proposed_tokens  # drafts were both taken and refused
    sampled = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True, logit_bias={common[0][0]: -100.0})
    assert all(common[0][0] not in o.outputs[0].token_ids for o in spec.generate(PROMPTS * 3, sampled))
