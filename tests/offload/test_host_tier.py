"""The host-memory tier: LRU within a byte budget, tokens checked on every lookup."""

import torch

from kvyard.offload.host_tier import HostTier, tensors_nbytes


def _block(value: float) -> list[list[torch.Tensor]]:
    return [[torch.full((4, 2, 8), float(value)), torch.full((4, 2, 8), -float(value))] for _ in range(2)]


def test_least_recently_used_blocks_go_first_and_the_budget_holds():
    size = tensors_nbytes(_block(0.0))
    tier = HostTier(capacity_bytes=3 * size)
    for i in range(3):
        assert tier.put(bytes([i]), (i,), _block(i))
    assert tier.get(bytes([0]), (0,)) is not None  # 0 is now the most recent; 1 the least
    tier.put(bytes([3]), (3,), _block(3))
    assert bytes([1]) not in tier and all(bytes([i]) in tier for i in (0, 2, 3))
    assert tier.used_bytes == 3 * size <= tier.capacity_bytes
    assert tier.stats.evicted == 1 and tier.stats.stored == 4
    entry = tier.get(bytes([3]), (3,))
    assert entry is not None and torch.equal(entry.tensors[1][1], torch.full((4, 2, 8), -3.0))


def test_a_lookup_with_other_tokens_misses_and_an_oversized_block_is_refused():
    size = tensors_nbytes(_block(0.0))
    tier = HostTier(capacity_bytes=size)
    tier.put(b"h", (1, 2), _block(1))
    assert tier.get(b"h", (1, 3)) is None  # a colliding hash never serves another block's KV
    small = HostTier(capacity_bytes=size - 1)
    assert not small.put(b"h", (1,), _block(1)) and len(small) == 0 and small.stats.rejected == 1
