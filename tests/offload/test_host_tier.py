"""The host-memory tier: a pool of its own, LRU within its byte budget, tokens checked on every lookup, and
blocks moved in and out by row copies."""

import torch

from kvyard.offload.host_tier import HostTier, block_nbytes

BS = 4
LAYOUT = [[((BS, 2, 8), torch.float32), ((BS, 2, 8), torch.float32)] for _ in range(2)]


def _blocks(values: list[float]) -> list[list[torch.Tensor]]:
    """Per layer [k, v] of len(values) blocks, block i filled with values[i] (v with its negative)."""
    def rows(sign: float) -> torch.Tensor:
        return torch.cat([torch.full((BS, 2, 8), sign * v) for v in values])
    return [[rows(1.0), rows(-1.0)] for _ in LAYOUT]


def test_least_recently_used_blocks_go_first_and_the_budget_holds():
    tier = HostTier(capacity_bytes=3 * block_nbytes(LAYOUT) + 7, layout=LAYOUT)
    assert tier.num_blocks == 3
    tier.store([(bytes([i]), (i,)) for i in range(3)], _blocks([0.0, 1.0, 2.0]))
    assert tier.lookup(bytes([0]), (0,)) is not None  # 0 is now the most recent; 1 the least
    tier.store([(bytes([3]), (3,))], _blocks([3.0]))
    assert bytes([1]) not in tier and all(bytes([i]) in tier for i in (0, 2, 3))
    assert tier.used_bytes == 3 * block_nbytes(LAYOUT) <= tier.capacity_bytes
    assert tier.stats.evicted == 1 and tier.stats.stored == 4
    # Back into an engine-like cache: blocks 5 and 1 of a 6-block pool get the tier's blocks 3 and 0.
    dst = [[torch.zeros(6 * BS, 2, 8), torch.zeros(6 * BS, 2, 8)] for _ in LAYOUT]
    tier.load([tier.lookup(bytes([3]), (3,)), tier.lookup(bytes([0]), (0,))], dst, [5, 1])
    for k, v in dst:
        assert torch.equal(k[5 * BS : 6 * BS], torch.full((BS, 2, 8), 3.0)) and float(v[BS:2 * BS].abs().sum()) == 0
        assert float(k[: BS].abs().sum()) == 0


def test_a_lookup_with_other_tokens_misses_and_a_zero_budget_keeps_nothing():
    tier = HostTier(capacity_bytes=block_nbytes(LAYOUT), layout=LAYOUT)
    tier.store([(b"h", (1, 2))], _blocks([1.0]))
    assert tier.lookup(b"h", (1, 3)) is None  # a colliding hash never serves another block's KV
    assert tier.lookup(b"h", (1, 2)) == 0
    small = HostTier(capacity_bytes=block_nbytes(LAYOUT) - 1, layout=LAYOUT)
    small.store([(b"h", (1,))], _blocks([1.0]))
    assert len(small) == 0 and small.num_blocks == 0


def test_with_keep_evicted_a_store_hands_back_the_blocks_it_pushed_out_before_overwriting_them():
    tier = HostTier(capacity_bytes=2 * block_nbytes(LAYOUT), layout=LAYOUT, keep_evicted=True)
    assert tier.store([(b"a", (1,)), (b"b", (2,))], _blocks([1.0, 2.0])) is None  # room for both
    out = tier.store([(b"c", (3,)), (b"d", (4,))], _blocks([3.0, 4.0]))
    assert out is not None and out.items == [(b"a", (1,)), (b"b", (2,))]
    for k, v in out.tensors:
        assert torch.equal(k, torch.cat([torch.full((BS, 2, 8), 1.0), torch.full((BS, 2, 8), 2.0)]))
        assert torch.equal(v, -k)


def test_blocks_a_full_store_has_no_room_for_are_handed_back_too():
    tier = HostTier(capacity_bytes=block_nbytes(LAYOUT), layout=LAYOUT, keep_evicted=True)
    out = tier.store([(b"a", (1,)), (b"b", (2,)), (b"c", (3,))], _blocks([1.0, 2.0, 3.0]))
    assert list(tier.entries) == [b"a"] and out is not None and out.items == [(b"b", (2,)), (b"c", (3,))]
    assert torch.equal(out.tensors[0][0], torch.cat([torch.full((BS, 2, 8), v) for v in (2.0, 3.0)]))


def test_a_tier_in_a_shared_memory_file_is_found_again_by_the_next_worker(tmp_path):
    seg = tmp_path / "segment"
    first = HostTier(capacity_bytes=3 * block_nbytes(LAYOUT), layout=LAYOUT, segment_path=seg, fingerprint="f")
    assert first.segment is not None
    first.store([(bytes([i]) * 32, (i, i, i, i)) for i in range(3)], _blocks([0.0, 1.0, 2.0]))
    first.lookup(bytes([0]) * 32, (0, 0, 0, 0))  # 0 is now the most recently used; 1 the least
    # While it is open, a second worker cannot take the file: it gets private memory.
    busy = HostTier(capacity_bytes=3 * block_nbytes(LAYOUT), layout=LAYOUT, segment_path=seg, fingerprint="f")
    assert busy.segment is None and len(busy) == 0
    first.close()
    again = HostTier(capacity_bytes=3 * block_nbytes(LAYOUT), layout=LAYOUT, segment_path=seg, fingerprint="f")
    assert list(again.entries) == [bytes([i]) * 32 for i in (1, 2, 0)] and again.free == []
    dst = [[torch.zeros(BS, 2, 8), torch.zeros(BS, 2, 8)] for _ in LAYOUT]
    again.load([again.lookup(bytes([2]) * 32, (2, 2, 2, 2))], dst, [0])
    assert all(torch.equal(k, torch.full((BS, 2, 8), 2.0)) and torch.equal(v, -k) for k, v in dst)
    assert again.lookup(bytes([1]) * 32, (1, 1, 1, 9)) is None  # tokens are checked as ever
    again.close()
    # Another model or layout: the file is reset, never read.
    other = HostTier(capacity_bytes=3 * block_nbytes(LAYOUT), layout=LAYOUT, segment_path=seg, fingerprint="g")
    assert other.segment is not None and len(other) == 0
    other.close()
