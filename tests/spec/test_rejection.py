"""Rejection sampling keeps the target distribution, whatever the draft distribution is."""

import torch

from kvyard.spec.rejection import rejection_sample


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


def run(
    p: torch.Tensor, q: torch.Tensor | None, point: int | None, n: int, seed: int
) -> tuple[torch.Tensor, float]:
    gen = torch.Generator().manual_seed(seed)
    draft_gen = torch.Generator().manual_seed(seed + 1)
    counts = torch.zeros(p.numel())
    accepted = 0
    for _ in range(n):
        draft = point if q is None else int(torch.multinomial(q, 1, generator=draft_gen))
        token, ok = rejection_sample(p, draft, gen, q)
        counts[token] += 1
        accepted += ok
    return counts, accepted / n


P = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])


def test_fixed_draft_distribution_preserves_the_target():
    q = torch.tensor([0.40, 0.10, 0.10, 0.10, 0.05, 0.25])
    counts, rate = run(P, q, None, 20000, seed=0)
    assert chi_square_p_value(counts, P) > 0.01
    # Acceptance of Leviathan's scheme is sum(min(p, q)).
    assert abs(rate - float(torch.minimum(P, q).sum())) < 0.02


def test_point_mass_draft_preserves_the_target():
    counts, rate = run(P, None, 3, 20000, seed=1)
    assert chi_square_p_value(counts, P) > 0.01
    assert abs(rate - float(P[3])) < 0.02


def test_a_wrong_distribution_is_detected():
    # The test itself has power: sampling q instead of p is rejected.
    q = torch.tensor([0.40, 0.10, 0.10, 0.10, 0.05, 0.25])
    gen = torch.Generator().manual_seed(2)
    counts = torch.bincount(torch.multinomial(q, 20000, replacement=True, generator=gen), minlength=6).float()
    assert chi_square_p_value(counts, P) < 1e-6


def test_certain_and_impossible_drafts():
    gen = torch.Generator().manual_seed(3)
    p = torch.tensor([0.0, 1.0, 0.0])
    assert rejection_sample(p, 1, gen) == (1, True)
    token, ok = rejection_sample(p, 0, gen)
    assert (token, ok) == (1, False)
