import random

import pytest

from kvyard.engine.step_cost import StepCostModel, StepShape


def synthetic_step(tokens: int, context: int, rng: random.Random, noise: float = 0.0) -> tuple[StepShape, float]:
    """A step of `tokens` new tokens of one request after `context` cached ones, timed by a known law."""
    shape = StepShape()
    shape.add(context, tokens)
    seconds = 0.008 + 0.0003 * tokens + 0.00002 * shape.attended / 1000
    return shape, seconds * (1 + rng.uniform(-noise, noise))


def test_shape_counts_query_key_pairs():
    shape = StepShape()
    shape.add(10, 1)  # a decode at position 10 attends to 11 keys
    shape.add(0, 4)  # a fresh 4-token prompt: 1 + 2 + 3 + 4
    assert (shape.tokens, shape.attended) == (5, 21)
    assert shape.plus(4, 2) == StepShape(7, 21 + 5 + 6) and shape == StepShape(5, 21)


def test_learns_the_law_from_mixed_steps():
    rng = random.Random(0)
    model = StepCostModel()
    for _ in range(200):
        model.observe(*synthetic_step(rng.choice([1, 8, 64, 256, 512]), rng.randrange(0, 4000), rng, noise=0.02))
    assert model.ready
    for tokens, context in ((1, 100), (128, 0), (512, 3000)):
        shape, truth = synthetic_step(tokens, context, rng)
        assert model.predict(shape) == pytest.approx(truth, rel=0.05)


def test_no_fit_from_decode_steps_alone():
    """Steps that all carry the same few tokens say nothing about a prefill token's cost."""
    rng = random.Random(1)
    model = StepCostModel()
    for _ in range(100):
        model.observe(*synthetic_step(rng.choice([15, 16]), rng.randrange(100, 200), rng))
    assert not model.ready


def test_follows_a_machine_that_slows_down():
    rng = random.Random(2)
    model = StepCostModel()
    for _ in range(100):
        model.observe(*synthetic_step(rng.choice([1, 64, 512]), 0, rng))
    before = model.predict(StepShape(256, 0))
    for _ in range(300):  # twice as slow: another tenant, fewer threads
        shape, seconds = synthetic_step(rng.choice([1, 64, 512]), 0, rng)
        model.observe(shape, 2 * seconds)
    assert model.predict(StepShape(256, 0)) == pytest.approx(2 * before, rel=0.05)


def test_fit_tokens_stays_within_the_limit():
    rng = random.Random(3)
    model = StepCostModel()
    for _ in range(100):
        model.observe(*synthetic_step(rng.choice([1, 32, 256, 512]), rng.randrange(0, 2000), rng))
    decodes = StepShape()
    for _ in range(16):
        decodes.add(200, 1)
    limit = 0.040
    n = model.fit_tokens(decodes, 0, 512, limit)
    assert 0 < n < 512
    assert model.predict(decodes.plus(0, n)) <= limit < model.predict(decodes.plus(0, n + 1))
    # Deeper into a long prompt each token attends to more keys, so fewer fit.
    assert model.fit_tokens(decodes, 20_000, 512, limit) < n
    assert model.fit_tokens(decodes, 0, 512, model.predict(decodes) / 2) == 0


def test_one_long_prompt_then_decodes_is_enough_for_a_fit():
    """Two kinds of step cannot split a token's cost from a key's: the fit falls back on tokens alone."""
    rng = random.Random(4)
    model = StepCostModel()
    model.observe(*synthetic_step(300, 0, rng))
    for i in range(20):
        model.observe(*synthetic_step(1, 300 + i, rng))
    assert model.ready
    assert model.predict(StepShape(150, 150 * 151 // 2)) > model.predict(StepShape(1, 300))
