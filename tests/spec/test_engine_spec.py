"""Speculative decoding inside the engine: greedy output is exactly the output without it."""

import pytest

from kvyard import SamplingParams
from kvyard.engine.block_manager import block_hashes
from tests.spec.conftest import run_steps, spec_llm

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "def add(a, b):\n    return a + b\n\nprint(add",
    "x y z",
    "Paged attention keeps the KV cache in fixed-size blocks. Paged attention",
]


def token_ids(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def reference(base_llm):
    return token_ids(base_llm, PROMPTS)


def test_ngram_greedy_is_identical(target_path, reference):
    llm = spec_llm(target_path, speculative_method="ngram")
    assert token_ids(llm, PROMPTS) == reference
    stats = llm.engine.spec.stats
    assert stats.accepted_tokens > 0 and stats.mean_accepted_length > 1.0
    assert llm.engine.stats["generation_tokens"] == 40 * len(PROMPTS)


@pytest.mark.parametrize("drafter", ["same", "small"])
def test_draft_model_greedy_is_identical(target_path, small_draft_path, reference, drafter):
    draft = target_path if drafter == "same" else small_draft_path
    llm = spec_llm(target_path, speculative_model=str(draft), num_speculative_tokens=3)
    assert token_ids(llm, PROMPTS) == reference
    stats = llm.engine.spec.stats
    if drafter == "same":  # the target drafting for itself: every draft is accepted
        assert stats.proposed_tokens > 0 and stats.accepted_tokens == stats.proposed_tokens
        assert stats.mean_accepted_length > 3.5
    else:  # a poor drafter: most drafts are rejected and their KV rolled back
        assert stats.proposed_tokens > stats.accepted_tokens


class OracleProposer:
    """Proposes the true continuation with one token made wrong, at a position that cycles 0..k."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], k: int):
        self.truth, self.k, self.calls = truth, k, 0

    def propose(self, requests, num_tokens):
        out = {}
        for req in requests:
            prompt, produced = tuple(req.prompt_token_ids), req.output_token_ids
            nxt = self.truth[prompt][len(produced) : len(produced) + num_tokens[req.request_id]]
            wrong_at = self.calls % (self.k + 1)
            self.calls += 1
            out[req.request_id] = [t if i != wrong_at else (t + 1) % 300 for i, t in enumerate(nxt)]
        return out


def test_rejected_drafts_roll_back_exactly(target_path, base_llm, reference):
    llm = spec_llm(
        target_path, speculative_method="ngram", num_speculative_tokens=4, speculative_adaptive=False
    )
    prompts_ids = [base_llm.engine.tokenize(p) for p in PROMPTS]
    truth = {tuple(p): r for p, r in zip(prompts_ids, reference, strict=True)}
    llm.engine.spec.proposer = OracleProposer(truth, 4)
    assert token_ids(llm, prompts_ids) == reference
    stats = llm.engine.spec.stats
    # A wrong draft at position j keeps exactly the j drafts before it.
    assert 0 < stats.accepted_tokens < stats.proposed_tokens
    assert stats.emitted_tokens == stats.accepted_tokens + stats.verify_steps


def test_mixed_batch_with_prefill_chunks_sampling_and_stops(target_path, base_llm):
    ref_full = token_ids(base_llm, [PROMPTS[0]])[0]
    long_prompt = "Continuous batching admits requests every step. " * 6
    params = [
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),  # max_tokens inside an accepted run
        SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[ref_full[9]]),
        SamplingParams(
            max_tokens=30, temperature=0.0, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5
        ),
        SamplingParams(max_tokens=25, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.0, seed=4, ignore_eos=True, logprobs=2),
    ]
    late = [
        (long_prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
        (PROMPTS[1], SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True, stop=["\n"])),
    ]
    early = [(PROMPTS[0], p) for p in params]
    # A 16-token budget splits the late long prompt into chunks that share steps with verifications.
    spec = spec_llm(target_path, speculative_method="ngram", max_num_batched_tokens=16)
    base = spec_llm(target_path, max_num_batched_tokens=16)
    got = run_steps(spec, early, late)
    want = run_steps(base, early, late)
    for i in (0, 1, 2, 5, 6):  # greedy: identical, stops and lengths included
        assert got[i].token_ids == want[i].token_ids and got[i].finish_reason == want[i].finish_reason, i
        assert got[i].text == want[i].text
    assert got[0].token_ids == ref_full[:7]
    assert got[1].token_ids == ref_full[:10] and got[1].stop_reason == ref_full[9]
    for i in (3, 4):  # sampled: lengths and logprobs line up
        assert len(got[i].token_ids) == params[i].max_tokens and got[i].finish_reason == "length"
    assert [lp.token_id for lp in got[4].logprobs] == got[4].token_ids
    assert all(len(lp.top) == 2 for lp in got[4].logprobs)
    assert spec.engine.spec.stats.accepted_tokens > 0
    # The same seeds in the same batch give the same samples.
    again = run_steps(
        spec_llm(target_path, speculative_method="ngram", max_num_batched_tokens=16), early, late
    )
    assert [again[i].token_ids for i in (3, 4)] == [got[i].token_ids for i in (3, 4)]


def test_prefix_cache_only_holds_verified_tokens(target_path, base_llm, reference):
    llm = spec_llm(target_path, speculative_model=str(target_path), num_speculative_tokens=4, block_size=4)
    out = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in out] == reference
    valid = set()
    for o in out:
        valid.update(block_hashes(o.prompt_token_ids + o.outputs[0].token_ids, 4))
    blocks = llm.engine.blocks
    assert blocks.num_cached_blocks > 0 and set(blocks.cached) <= valid
    # A follow-up turn reuses the cached KV and still matches plain decoding.
    follow = [o.prompt_token_ids + o.outputs[0].token_ids for o in out[:2]]
    hits_before = blocks.hit_tokens
    assert token_ids(llm, follow) == token_ids(base_llm, follow)
    assert blocks.hit_tokens > hits_before


def test_large_batches_do_not_speculate(target_path):
    llm = spec_llm(target_path, speculative_method="ngram", speculative_max_batch=2)
    llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert llm.engine.spec.stats.drafter_steps == 0
