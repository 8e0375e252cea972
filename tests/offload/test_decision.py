"""Load or recompute: a tier's blocks are read back only as far as that beats recomputing them, by the engine's
own step-cost model and each tier's measured rate."""

from kvyard.engine.step_cost import StepCostModel, StepShape
from kvyard.offload.decision import LoadOrRecompute, TierRate

BS = 4


def _cost(per_token_s: float = 1e-3) -> StepCostModel:
    """A cost model fitted to steps costing 5 ms plus per_token_s a token (attention free)."""
    cost = StepCostModel()
    for n in (1, 8, 64, 200, 32, 1, 128):
        shape = StepShape()
        shape.add(0, n)
        cost.observe(shape, 5e-3 + per_token_s * n)
    assert cost.ready
    return cost


def _decide(mode: str = "auto", **rates: float) -> LoadOrRecompute:
    d = LoadOrRecompute(_cost(), BS, mode)
    for tier, seconds in rates.items():
        d.rates[tier] = TierRate(seconds)
    return d


def test_a_tier_slower_than_recomputing_is_not_read():
    # recomputing a block of 4 tokens costs about 4 ms here
    assert _decide(host=1e-4).blocks_to_load(["host"] * 5) == 5
    slow = _decide(disk=20e-3)
    assert slow.blocks_to_load([None, None, "disk", "disk"]) == 2  # the pool's blocks, then recompute
    assert (slow.decisions.loaded, slow.decisions.recomputed) == (0, 2)
    # a fast tier's blocks are worth it even past a slow one's, as long as the prefix saves time in all
    mixed = _decide(host=1e-4, disk=6e-3)
    assert mixed.blocks_to_load(["host", "host", "host", "disk", "host", "host"]) == 6
    assert mixed.blocks_to_load(["host", "disk", "disk", "disk", "host"]) == 1
    assert mixed.decisions.saved_seconds > 0


def test_forced_modes_and_an_unmeasured_engine():
    assert _decide("load", disk=1.0).blocks_to_load([None, "disk", "disk"]) == 3
    assert _decide("recompute", host=0.0).blocks_to_load([None, None, "host", None, "host"]) == 2
    cold = LoadOrRecompute(StepCostModel(), BS)  # no fit yet: loading is assumed to pay, and gets measured
    assert cold.blocks_to_load(["disk", "disk"]) == 2


def test_rates_follow_measurements():
    rate = TierRate()
    rate.observe(0.010, 2)
    assert rate.seconds_per_block == 0.005
    rate.observe(0.001, 1)
    assert 0.001 < rate.seconds_per_block < 0.005


def test_without_a_fit_the_engines_mean_seconds_per_token_prices_a_block():
    d = LoadOrRecompute(StepCostModel(), BS, "auto")
    d.rates["disk"] = TierRate(0.05)
    assert d.recompute_seconds(0) is None and d.blocks_to_load(["disk"] * 3) == 3  # nothing known: load
    d.seconds_per_token = lambda: 1e-4  # a block costs 0.4 ms to recompute: the 50 ms tier is not read
    assert d.recompute_seconds(3) == 4e-4 and d.blocks_to_load(["disk"] * 3) == 0
