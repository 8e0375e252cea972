"""Leviathan et al.'s rejection sampling: verify a drafted token so that the output follows the target.

Accept draft token d with probability min(1, p(d) / q(d)); on rejection draw from norm(max(p - q, 0)).
Whatever the draft distribution q, the emitted token is distributed exactly as p. A deterministic
drafter (n-gram lookup, a greedy draft model) is the point mass q = 1{d}: accept with probability
p(d), and on rejection draw from p with d removed, renormalised.
"""

import torch

from kvyard.engine.sampler import draw


def rejection_sample(
    p: torch.Tensor, draft: int, generator: torch.Generator | None, q: torch.Tensor | None = None
) -> tuple[int, bool]:
    """Return (token, accepted) for draft token `draft` under target probabilities `p` (1-D).

    `q` is the draft's distribution; None means the draft was deterministic (a point mass on `draft`).
    """
    p = p.float()
    pd = float(p[draft])
    qd = 1.0 if q is None else float(q[draft])
    u = float(torch.rand((), generator=generator))
    if qd <= 0.0 or u * qd < pd:
        return draft, True
    residual = p.clone()
    if q is None:
        residual[draft] = 0.0
    else:
        residual = (residual - q.float().to(p.device)).clamp_(min=0.0)
    if float(residual.sum()) <= 0.0:
        return draft, True  # p equals q up to rounding: a rejection has probability zero
    return draw(residual, generator), False
