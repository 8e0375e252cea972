"""Load or recompute: which of a prompt's blocks in the tiers are worth reading back, from measured rates.

Each tier's cost of putting a block back into the pool (read, check, copy) is an exponentially weighted mean of
what its restores took; the engine's cost of recomputing a block comes from its own step-cost model
(kvyard/engine/step_cost.py): tokens at `b` seconds each and attention at `c` per thousand query-key pairs,
which grows with the block's position. The blocks form a chain, so the choice is how far into the prompt to
restore: the prefix whose blocks save the most time in all (recomputing the rest). A tier never measured is
assumed free, so it gets measured; a tier slower than recomputing stops being read, and a short prompt never
waits on a slow tier.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from kvyard.engine.step_cost import ATTENDED_UNIT, StepCostModel

SMOOTHING = 0.2  # weight of the newest measurement in a tier's mean


@dataclass
class TierRate:
    seconds_per_block: float | None = None

    def observe(self, seconds: float, blocks: int) -> None:
        rate = seconds / blocks
        old = self.seconds_per_block
        self.seconds_per_block = rate if old is None else (1 - SMOOTHING) * old + SMOOTHING * rate


@dataclass
class Decisions:
    loaded: int = 0  # blocks read back from a tier
    recomputed: int = 0  # blocks a tier held that were cheaper to recompute
    saved_seconds: float = 0.0  # estimated prefill time the loaded blocks saved, net of loading them


@dataclass
class LoadOrRecompute:
    cost: StepCostModel
    block_size: int
    mode: str = "auto"  # auto, load (always) or recompute (never read a tier)
    rates: dict[str, TierRate] = field(default_factory=dict)
    decisions: Decisions = field(default_factory=Decisions)
    # Before the cost model has a fit (a model so small that its steps' times hardly depend on their tokens):
    # the engine's mean seconds per token so far, an upper bound that errs towards loading; None: no steps yet
    seconds_per_token: Callable[[], float | None] = lambda: None

    def recompute_seconds(self, index: int) -> float | None:
        """What computing block `index` of a prompt costs the engine; None before it has run a step."""
        if not self.cost.ready:
            per_token = self.seconds_per_token()
            return None if per_token is None else per_token * self.block_size
        _, per_token, per_kilo_pair = self.cost.coefficients
        bs = self.block_size
        pairs = bs * index * bs + bs * (bs + 1) // 2
        return per_token * bs + per_kilo_pair * pairs / ATTENDED_UNIT

    def load_seconds(self, tier: str) -> float:
        return self.rates.setdefault(tier, TierRate()).seconds_per_block or 0.0

    def blocks_to_load(self, where: list[str | None]) -> int:
        """`where[i]`: the tier holding block i, or None where the pool holds it. Returns how many leading
        blocks to restore (the rest of the prompt is recomputed)."""
        if self.mode == "recompute":
            best = next((i for i, w in enumerate(where) if w is not None), len(where))
        elif self.mode == "load":
            best = len(where)
        else:
            best, saving, total = 0, 0.0, 0.0
            for i, tier in enumerate(where):
                if tier is not None:
                    recompute = self.recompute_seconds(i)
                    total += (recompute - self.load_seconds(tier)) if recompute is not None else 0.0
                if total >= saving:  # ties go to loading: it frees the compute for other requests
                    best, saving = i + 1, total
            self.decisions.saved_seconds += saving
        loaded = sum(1 for w in where[:best] if w is not None)
        self.decisions.loaded += loaded
        self.decisions.recomputed += sum(1 for w in where if w is not None) - loaded
        return best
