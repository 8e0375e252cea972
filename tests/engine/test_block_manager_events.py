"""KV events mirror the prefix cache exactly: replaying them gives the set of hashes a request could hit."""

import random

from kvyard.engine.block_manager import BlockManager, block_hashes
from kvyard.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, apply_events
from kvyard.engine.request import Request
from kvyard.sampling_params import SamplingParams


def request(tokens, salt=b"") -> Request:
    r = Request("r", list(tokens), SamplingParams(max_tokens=4, temperature=0))
    r.cache_salt = salt
    return r


def prefill(m: BlockManager, r: Request) -> bool:
    hits = m.match_prefix(r)
    if not m.can_fit(r, r.num_tokens, hits):
        return False
    m.admit(r, r.num_tokens, hits)
    r.num_computed_tokens = r.num_tokens
    m.commit(r)
    return True


def test_stored_events_carry_chained_hashes_parents_and_tokens():
    m = BlockManager(16, 4)
    assert m.enable_events() == set()
    r = request(range(10))
    prefill(m, r)
    [ev] = m.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == block_hashes(list(range(10)), 4)  # the router's function agrees
    assert ev.parent_hash is None and ev.token_ids == list(range(8)) and ev.block_size == 4
    assert m.take_events() == []  # drained
    # Two more tokens fill block 3: one event whose parent is block 2.
    r.token_ids += [10, 11]
    r.num_computed_tokens = 12
    m.commit(r)
    [ev] = m.take_events()
    assert ev.parent_hash == block_hashes(list(range(8)), 4)[-1] and ev.token_ids == [8, 9, 10, 11]


def test_a_duplicate_block_is_not_announced_and_salt_changes_hashes():
    m = BlockManager(16, 4)
    m.enable_events()
    prefill(m, request(range(8)))
    m.take_events()
    b = request(range(8))  # its last block is recomputed, so it fills a second block with a known hash
    prefill(m, b)
    assert m.take_events() == []
    prefill(m, request(range(8), salt=b"tenant"))
    [ev] = m.take_events()
    assert ev.block_hashes == block_hashes(list(range(8)), 4, b"tenant") != block_hashes(list(range(8)), 4)


def test_evictions_are_removed_events_coalesced():
    m = BlockManager(4, 2)
    m.enable_events()
    a = request(range(8))
    prefill(m, a)
    m.free(a)
    m.take_events()
    prefill(m, request(range(100, 108)))  # needs all four blocks: every cached one is evicted
    events = m.take_events()
    assert isinstance(events[0], BlockRemoved) and len(events[0].block_hashes) == 4
    assert set(events[0].block_hashes) == set(block_hashes(list(range(8)), 2))


def test_random_workload_replay_matches_the_cache_at_every_step():
    rng = random.Random(7)
    m = BlockManager(24, 4)
    mirror = m.enable_events()
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 16))] for _ in range(5)]
    live: list[Request] = []
    for _ in range(300):
        if live and rng.random() < 0.45:
            m.free(live.pop(rng.randrange(len(live))))
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
            r = request(tokens, salt=rng.choice([b"", b"s"]))
            if prefill(m, r):
                live.append(r)
        apply_events(mirror, m.take_events())
        assert mirror == set(m.cached)
    assert len(mirror) > 0


def test_events_off_by_default_and_all_cleared_replays():
    m = BlockManager(8, 4)
    prefill(m, request(range(8)))
    assert m.events is None and m.take_events() == []
    hashes = {b"x", b"y"}
    apply_events(hashes, [AllBlocksCleared()])
    assert hashes == set()
