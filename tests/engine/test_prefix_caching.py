"""Prefix caching must never change a greedy token (fp32): full hits, partial hits, eviction, preemption."""

import pytest

from kvyard import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SYSTEM = "You are a careful assistant. Paged attention keeps the KV cache in fixed-size blocks. " * 3


def outputs(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return str(tiny_checkpoint("qwen2"))


def reference(path: str, prompts: list[str]) -> list[list[int]]:
    return outputs(LLM(path, dtype="float32", enable_prefix_caching=False), prompts)


def test_full_and_partial_hits_give_identical_tokens(path):
    prompts = [SYSTEM + "Question one?", SYSTEM + "Question two, longer?", SYSTEM + "Question one?"]
    llm = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=64)
    first = outputs(llm, prompts[:1])
    assert llm.engine.blocks.hit_tokens == 0
    rest = outputs(llm, prompts[1:])  # partial hit (shared system prompt), then a full hit
    assert first + rest == reference(path, prompts)
    blocks = llm.engine.blocks
    assert blocks.hit_tokens > 0 and blocks.num_cached_blocks > 0
    assert blocks.num_free_blocks == blocks.num_blocks  # cached blocks are reclaimable, never leaked


def test_hits_after_eviction_and_under_preemption(path):
    system = SYSTEM[: len(SYSTEM) // 3]
    prompts = [system + f"Variant {i}: item {i * 7}." for i in range(6)]
    # 32 blocks of 4 tokens: far less than six prompts need, so blocks are evicted and requests preempted.
    llm = LLM(path, dtype="float32", block_size=4, kv_cache_memory=32 * 4 * 2 * 2 * 2 * 16 * 4,
              max_num_batched_tokens=32)
    got = outputs(llm, prompts) + outputs(llm, prompts[::-1])
    assert got == reference(path, prompts) + reference(path, prompts[::-1])
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.blocks.hit_tokens > 0


def test_cache_off_means_no_reuse(path):
    llm = LLM(path, dtype="float32", enable_prefix_caching=False)
    outputs(llm, [SYSTEM, SYSTEM])
    assert llm.engine.blocks.hit_tokens == 0 and llm.engine.blocks.num_cached_blocks == 0
