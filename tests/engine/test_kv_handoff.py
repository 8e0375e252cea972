"""KV handed between engines (prefill/decode disaggregation): held blocks on the prefill side, adopted blocks
on the decode side, greedy output identical to one engine doing both, and no block leaked either way."""

import time

import pytest

from kvyard import LLM, SamplingParams
from kvyard.disagg.blocks import gather_blocks
from kvyard.disagg.payload import KVIntegrityError
from kvyard.engine.block_manager import BlockManager, block_hashes
from kvyard.engine.request import Request

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT = "You are a careful assistant. Paged attention keeps the KV cache in fixed-size blocks. " * 2


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def make(path: str) -> LLM:
    return LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=32)


def prefill_and_hold(llm: LLM, ids: list[int]):
    eng = llm.engine
    rid = eng.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), hold_kv=True)
    while eng.has_unfinished_requests():
        eng.step()
    return eng.held[rid]


def test_block_manager_adopt_pins_nothing_and_skips_cached_blocks():
    bm = BlockManager(num_blocks=8, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = block_hashes(tokens, 2)
    taken = bm.adopt(tokens, hashes[:2])
    assert [i for i, _ in taken] == [0, 1]
    bm.release([b for _, b in taken])
    again = bm.adopt(tokens, hashes)  # the first two are cached already: only the third is new
    assert [i for i, _ in again] == [2]
    bm.release([b for _, b in again])
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 3
    req = Request("r", tokens + [7], GREEDY)
    assert len(bm.match_prefix(req)) == 3  # a request for the same prompt hits every adopted block


def test_block_manager_adopt_stops_when_the_pool_is_full():
    bm = BlockManager(num_blocks=2, block_size=2)
    tokens = list(range(8))
    taken = bm.adopt(tokens, block_hashes(tokens, 2))
    assert [i for i, _ in taken] == [0, 1]  # leading blocks first: a prefix is what a request can use
    bm.release([b for _, b in taken])
    assert bm.num_free_blocks == 2


def test_held_kv_outlives_its_request_until_released(path):
    llm = make(path)
    eng = llm.engine
    ids = eng.tokenize(PROMPT)
    held = prefill_and_hold(llm, ids)
    assert len(held.block_ids) == len(ids) // 4 and held.token_ids == ids[: len(held.block_ids) * 4]
    assert held.block_hashes == block_hashes(ids, 4)[: len(held.block_ids)]
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks - len(held.block_ids)
    assert all(eng.blocks.blocks[b].ref_count == 1 for b in held.block_ids)
    assert eng.release_kv(held.request_id) and not eng.release_kv(held.request_id)
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks and not eng.held


def test_failed_or_aborted_requests_hold_nothing(path):
    llm = make(path)
    eng = llm.engine
    rid = eng.add_request(PROMPT, SamplingParams(max_tokens=4), hold_kv=True)
    eng.step()
    eng.abort_request(rid)
    eng.step()
    assert not eng.held and eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_adopted_kv_gives_identical_greedy_tokens_and_is_hit(path):
    prefill, decode, colocated = make(path), make(path), make(path)
    ids = prefill.engine.tokenize(PROMPT)
    held = prefill_and_hold(prefill, ids)
    usable = (len(ids) - 1) // 4
    tensors = gather_blocks(prefill.engine.runner.kv_caches, held.block_ids[:usable], 4)
    added = decode.engine.adopt_kv(held.token_ids[: usable * 4], held.block_hashes[:usable], tensors)
    assert added == usable
    got = decode.generate([ids], GREEDY)[0].outputs[0].token_ids
    assert got == colocated.generate([ids], GREEDY)[0].outputs[0].token_ids
    blocks = decode.engine.blocks
    assert blocks.hit_tokens == usable * 4  # every adopted block was used, only the rest computed
    assert blocks.num_free_blocks == blocks.num_blocks
    prefill.engine.release_kv(held.request_id)
    assert prefill.engine.blocks.num_free_blocks == prefill.engine.blocks.num_blocks


def test_kv_adopted_after_its_lease_is_dropped(path):
    """In-place KV (another process's shared memory) copied after its lease ran out may have been rewritten:
    the blocks are taken out of the prefix cache again and the request recomputes them."""
    prefill, decode = make(path), make(path)
    ids = prefill.engine.tokenize(PROMPT)
    held = prefill_and_hold(prefill, ids)
    usable = (len(ids) - 1) // 4
    tensors = gather_blocks(prefill.engine.runner.kv_caches, held.block_ids[:usable], 4)
    with pytest.raises(KVIntegrityError, match="lease ran out"):
        decode.engine.adopt_kv(held.token_ids[: usable * 4], held.block_hashes[:usable], tensors,
                               valid_until=time.monotonic() - 1)
    blocks = decode.engine.blocks
    assert blocks.num_free_blocks == blocks.num_blocks and not blocks.cached
    decode.generate([ids], GREEDY)
    assert blocks.hit_tokens == 0
