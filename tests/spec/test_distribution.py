"""At temperature 1 the engine's speculative samples follow the same distribution as plain sampling.

A random tiny model is nearly uniform over its vocabulary at temperature 1, so greedy drafts would
almost never be accepted; top_k=6 (part of the target distribution) makes acceptance frequent.
"""

import torch

from kvyard import SamplingParams
from tests.spec.conftest import spec_llm

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy"
N = 300


def samples(llm) -> list[list[int]]:
    params = [
        SamplingParams(max_tokens=4, temperature=1.0, top_k=6, seed=1000 + i, ignore_eos=True)
        for i in range(N)
    ]
    return [o.outputs[0].token_ids for o in llm.generate([PROMPT] * N, params)]


def homogeneity_p_value(a: list[int], b: list[int]) -> float:
    """Chi-square test that two samples come from one distribution (rare categories pooled)."""
    cats = sorted(set(a) | set(b))
    table = torch.tensor([[a.count(c) for c in cats], [b.count(c) for c in cats]], dtype=torch.float64)
    common = table.sum(0) >= 10
    table = torch.cat([table[:, common], table[:, ~common].sum(1, keepdim=True)], 1)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    df = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def test_sampling_distribution_is_preserved(target_path):
    opts = dict(max_num_seqs=128, max_num_batched_tokens=512, speculative_max_batch=128)
    plain = samples(spec_llm(target_path, **opts))
    # The target drafting greedily for itself: drafts exist at every step and are accepted with p(argmax).
    spec_llm_ = spec_llm(
        target_path,
        speculative_model=str(target_path),
        speculative_adaptive=False,
        num_speculative_tokens=2,
        **opts,
    )
    spec = samples(spec_llm_)
    stats = spec_llm_.engine.spec.stats
    assert stats.proposed_tokens > N and 0 < stats.accepted_tokens < stats.proposed_tokens
    for pos in (1, 2, 3):  # the positions that verification produced
        assert homogeneity_p_value([s[pos] for s in plain], [s[pos] for s in spec]) > 0.01
        assert len({s[pos] for s in spec}) > 3  # a real distribution, not a point mass
    # Joint pairs too: the second token depends on the first in the same way.
    pairs = lambda ss: [s[1] * 1000 + s[2] for s in ss]  # noqa: E731
    assert homogeneity_p_value(pairs(plain), pairs(spec)) > 0.01
