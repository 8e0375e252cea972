"""Prompt logprobs against HF transformers' log_softmax, with chunked prefill and with a cached prefix.

A cached prefix has KV but no logits, so a request that asks for prompt logprobs computes its whole
prompt (kvyard/engine/prompt_logprobs.py); the numbers must not depend on what is in the cache.
"""

import pytest
import torch

from kvyard import LLM, SamplingParams
from tests.conftest import hf_reference

TEXT = ("Paged attention keeps the KV cache in fixed-size blocks. Continuous batching admits requests every "
        "step. The quick brown fox jumps over the lazy dog.")
TOP = 5


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def llm(path):
    # 16-token chunks over a prompt of ~50 tokens: every prompt is prefilled in several steps.
    return LLM(str(path), dtype="float32", max_num_batched_tokens=16, block_size=8)


@pytest.fixture(scope="module")
def prompt(llm):
    ids = llm.tokenizer(TEXT, add_special_tokens=True).input_ids
    assert len(ids) > 40
    return ids


@pytest.fixture(scope="module")
def oracle(path, prompt):
    with torch.no_grad():
        logits = hf_reference(path)(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(-1)


def check(scored, prompt, oracle):
    assert len(scored) == len(prompt) and scored[0] is None
    for p, lp in enumerate(scored[1:], start=1):
        row = oracle[p - 1]
        assert lp.token_id == prompt[p]
        assert lp.logprob == pytest.approx(float(row[prompt[p]]), abs=1e-4)
        assert lp.rank == int((row > row[prompt[p]]).sum()) + 1
        top_vals, top_ids = row.topk(TOP)
        assert list(lp.top) == top_ids.tolist()
        assert list(lp.top.values()) == pytest.approx(top_vals.tolist(), abs=1e-4)


def scored_prompt(llm, prompt, **params):
    out = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP, **params))[0]
    return out.prompt_logprobs


def test_chunked_prefill_matches_hf(llm, prompt, oracle):
    check(scored_prompt(llm, prompt), prompt, oracle)
    assert llm.generate([prompt], SamplingParams(max_tokens=1))[0].prompt_logprobs is None  # only when asked


def test_a_cached_prefix_is_recomputed_and_still_cached_for_others(llm, prompt, oracle):
    blocks = llm.engine.blocks
    llm.generate([prompt], SamplingParams(max_tokens=1))  # the prompt's blocks are in the cache now
    hits = blocks.hit_tokens
    check(scored_prompt(llm, prompt), prompt, oracle)
    assert blocks.hit_tokens == hits  # it read nothing from the cache...
    llm.generate([prompt], SamplingParams(max_tokens=1))
    assert blocks.hit_tokens - hits >= len(prompt) - 8  # ...and others still hit its prefix


def test_prompt_of_one_token_and_zero_alternatives(llm, prompt, oracle):
    assert scored_prompt(llm, prompt[:1]) == [None]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
    assert all(lp.top == {} for lp in out[1:])
    assert [lp.logprob for lp in out[1:]] == pytest.approx(
        [float(oracle[p - 1, prompt[p]]) for p in range(1, len(prompt))], abs=1e-4)


def test_preempted_requests_score_each_token_once(path, prompt, oracle):
    # 60 blocks of 4 tokens for four requests that each grow to 100: they preempt one another, and a
    # recompute from scratch must neither score the prompt twice nor change a number.
    tight = LLM(str(path), dtype="float32", kv_cache_memory="120KiB", block_size=4, max_num_batched_tokens=16)
    outs = tight.generate([prompt] * 4, SamplingParams(max_tokens=40, temperature=1.0, ignore_eos=True,
                                                       prompt_logprobs=TOP))
    assert tight.engine.scheduler.num_preemptions > 0
    for out in outs:
        check(out.prompt_logprobs, prompt, oracle)
