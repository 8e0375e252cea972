import kvyard.engine.block_manager as bm
from kvyard.engine.block_manager import BlockManager
from kvyard.engine.request import Request
from kvyard.sampling_params import SamplingParams


def request(tokens, salt=b"") -> Request:
    r = Request("r", list(tokens), SamplingParams(max_tokens=4, temperature=0))
    r.cache_salt = salt
    return r


def run_prefill(m: BlockManager, r: Request) -> None:
    """Admit with whatever the cache offers, then pretend every prompt token was computed."""
    hits = m.match_prefix(r)
    m.admit(r, r.num_tokens, hits)
    r.num_computed_tokens = r.num_tokens
    m.commit(r)


def test_full_blocks_are_reused_and_last_token_is_left_to_compute():
    m = BlockManager(16, 4)
    a = request(range(12))
    run_prefill(m, a)
    b = request(range(12))
    hits = m.match_prefix(b)
    assert hits == a.block_table[:2]  # 3 full blocks, but the last token must be computed again
    c = request(list(range(8)) + [99, 98, 97, 96, 95])
    assert m.match_prefix(c) == a.block_table[:2]  # shares the first two blocks only
    assert m.match_prefix(request([0, 1, 2, 99, 4, 5, 6, 7, 8])) == []


def test_shared_blocks_are_reference_counted():
    m = BlockManager(8, 4)
    a, b = request(range(9)), request(range(9))
    run_prefill(m, a)
    run_prefill(m, b)
    assert a.block_table[:2] == b.block_table[:2] and a.block_table[2] != b.block_table[2]
    assert m.num_free_blocks == 8 - 4
    m.free(a)
    assert m.num_free_blocks == 8 - 3  # the shared blocks are still held by b
    m.free(b)
    assert m.num_free_blocks == 8 and m.num_cached_blocks == 2


def test_a_block_is_known_by_its_whole_prefix_not_its_own_tokens():
    """Block 1 of [0..3][4..7] holds KV of 4..7 at positions 4..7, after 0..3: a prompt that starts with 4..7
    must not read it (its hash chains its parent's)."""
    m = BlockManager(8, 4)
    a = request(range(9))
    run_prefill(m, a)
    assert m.match_prefix(request([4, 5, 6, 7, 100])) == []
    assert m.match_prefix(request([*range(8), 100])) == a.block_table[:2]


def test_salt_isolates_requests():
    m = BlockManager(8, 4)
    run_prefill(m, request(range(9), salt=b"tenant-a"))
    assert m.match_prefix(request(range(9), salt=b"tenant-b")) == []
    assert len(m.match_prefix(request(range(9), salt=b"tenant-a"))) == 2


def test_hash_collision_never_serves_wrong_blocks(monkeypatch):
    monkeypatch.setattr(bm, "block_hash", lambda parent, tokens, salt=b"": b"same")
    m = BlockManager(8, 4)
    run_prefill(m, request(range(9)))
    assert m.match_prefix(request(range(100, 109))) == []


def test_plain_blocks_are_used_before_cached_ones_and_tails_are_evicted_first():
    m = BlockManager(4, 4)
    a = request(range(13))  # 4 blocks, 3 of them full and cached
    run_prefill(m, a)
    head, mid, tail, partial = a.block_table
    m.free(a)
    fresh = request([7])
    m.admit(fresh, 1, [])
    assert fresh.block_table == [partial]  # the uncached block goes first: nothing is evicted
    other = request([5] * 5)
    m.admit(other, 5, [])  # needs two more blocks: evicts the tail, then the middle
    assert set(other.block_table) == {tail, mid}
    assert m.match_prefix(request(range(13))) == [head]


def test_hit_rate_counts_tokens():
    m = BlockManager(16, 4)
    run_prefill(m, request(range(12)))
    run_prefill(m, request(range(12)))
    assert m.hit_tokens == 8 and m.queried_tokens == 24 and m.hit_rate == 8 / 24
