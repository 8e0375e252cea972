"""Sliding-window pools: blocks behind every window go back to the pool, so a long sequence's KV for those
layers stays bounded by the window, while the outputs stay exactly HF's (tiny Mistral and Gemma 3)."""

import torch

from kvyard import LLM, SamplingParams
from kvyard.engine.block_manager import NULL_BLOCK
from kvyard.engine.kv_cache import KVGroups, bytes_per_block, pool_sizes
from kvyard.engine.request import Request
from kvyard.engine.window_blocks import HybridBlocks, WindowBlocks
from kvyard.models.config import ModelConfig
from tests.conftest import hf_greedy, hf_reference

WINDOW, BLOCK = 7, 4
# The most blocks a window of 7 can touch with blocks of 4 at one position, plus one being filled ahead.
WINDOW_BOUND = -(-(WINDOW - 1) // BLOCK) + 2


def _decode(pool: WindowBlocks, req: Request, steps: int) -> int:
    """Decode `steps` tokens one at a time; returns the most blocks the request held at once."""
    most = 0
    for _ in range(steps):
        req.token_ids.append(1)
        pool.grow(req, req.num_computed_tokens + 1)
        most = max(most, pool.live_blocks(req))
        req.num_computed_tokens += 1
        pool.commit(req)
    return most


def _request(n: int) -> Request:
    return Request("r", list(range(1, n + 1)), SamplingParams(max_tokens=1))


def test_blocks_behind_the_window_go_back_and_stay_hittable():
    pool = WindowBlocks(32, BLOCK, WINDOW)
    req = _request(5)
    pool.admit(req, 5, [])
    req.num_computed_tokens = 5
    pool.commit(req)
    most = _decode(pool, req, 100)
    assert most <= WINDOW_BOUND and pool.live_blocks(req) <= WINDOW_BOUND
    assert pool.num_blocks - pool.num_free_blocks == pool.live_blocks(req)  # the rest went back
    # Given-back blocks are a prefix of the table, each still at its position's index.
    table = pool.table(req)
    assert len(table) == pool.blocks_needed(req.num_computed_tokens)
    assert table[: -WINDOW_BOUND] == [NULL_BLOCK] * (len(table) - WINDOW_BOUND)
    # The same sequence again: a hit needs only the blocks under the window at its end (cached, not freed).
    again = Request("s", list(req.token_ids), SamplingParams(max_tokens=1))
    hits = pool.match_prefix(again)
    assert len(hits) == (again.num_tokens - 1) // BLOCK
    assert hits[0] == NULL_BLOCK and all(b != NULL_BLOCK for b in hits[pool.first_live_block(len(hits) * BLOCK):])
    pool.free(req)
    assert pool.num_free_blocks == pool.num_blocks


def test_a_hybrid_hit_is_cut_where_the_window_pool_lost_a_block():
    pools = HybridBlocks(64, 16, BLOCK, WINDOW)
    req = _request(40)
    pools.admit(req, 40, [])
    req.num_computed_tokens = 40
    pools.commit(req)
    assert pools.window_pool.live_blocks(req) <= WINDOW_BOUND and len(req.block_table) == 10
    pools.free(req)
    same = _request(40)
    assert len(pools.match_prefix(same)) == 9  # full layers and window both cached
    # Evict the window pool's cached blocks: the full layers' prefix alone is no hit.
    filler = Request("f", list(range(1000, 1064)), SamplingParams(max_tokens=1))
    pools.window_pool.grow(filler, 64)
    assert pools.match_prefix(same) == []


def test_the_budget_of_sliding_layers_beyond_their_windows_goes_to_full_layers():
    cfg = ModelConfig("gemma3_text", vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=6,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                      max_position_embeddings=4096, tie_word_embeddings=True, attention_bias=False, qk_norm=True,
                      layer_windows=(WINDOW,) * 5 + (None,))
    groups = KVGroups.of(cfg)
    assert groups.sliding_window == WINDOW and groups.sliding_layers == frozenset(range(5))
    budget = 4096 * bytes_per_block(cfg, BLOCK, torch.float32)
    full, window = pool_sizes(cfg, groups, BLOCK, torch.float32, budget, "auto", max_num_seqs=8,
                              max_num_batched_tokens=64)
    assert window == 8 * WINDOW_BOUND + 64 // BLOCK
    assert full > 4 * 4096  # nearly six times the uniform pool: five of six layers hold only windows
    per_layer = bytes_per_block(cfg, BLOCK, torch.float32) // 6
    assert (full + 5 * window) * per_layer <= budget


GREEDY = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)


def _peak_blocks(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], int, int]:
    """Generate; returns the tokens and the most blocks in use, in the main pool and in the window pool."""
    engine = llm.engine
    for p in prompts:
        engine.add_request(p, GREEDY)
    window_pool = getattr(engine.blocks, "window_pool", engine.blocks)
    main, window, done = 0, 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        main = max(main, engine.blocks.num_blocks - engine.blocks.num_free_blocks)
        window = max(window, window_pool.num_blocks - window_pool.num_free_blocks)
    return [done[k] for k in sorted(done, key=lambda rid: int(rid.rsplit("-", 1)[-1]))], main, window


def test_long_generations_hold_only_their_windows_and_match_transformers(tiny_checkpoint):
    for arch in ("mistral-sliding", "gemma3_text"):
        path = tiny_checkpoint(arch, arch == "gemma3_text")
        llm = LLM(str(path), dtype="float32", block_size=BLOCK, max_num_batched_tokens=16)
        prompts = [llm.tokenizer(t).input_ids for t in ("The quick brown fox jumps", "Paged attention")]
        got, main, window = _peak_blocks(llm, prompts)
        ref = hf_reference(path)
        assert got == [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts], arch
        longest = max(len(p) for p in prompts) + GREEDY.max_tokens
        # A chunk of 16 new tokens may sit above a window while it is computed.
        assert window <= len(prompts) * (WINDOW_BOUND + -(-16 // BLOCK)), arch
        if arch == "gemma3_text":  # its global layer keeps everything
            assert main >= len(prompts) * (longest // BLOCK) > 4 * window
        assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
