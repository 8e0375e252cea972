"""Stall-free batching: with streams decoding, a step takes only the prompt tokens that fit the inter-token target."""

import random

from kvyard.engine.scheduler import BURST_PROMPTS_PER_STREAM
from kvyard.engine.step_cost import StepCostModel, StepShape
from tests.engine.test_scheduler import make, request, run_step
from tests.engine.test_step_cost import synthetic_step

BLOCK = 16


def scheduler(**cfg):
    """A scheduler whose cost model has learned the synthetic law (8 ms + 0.3 ms a token + attention)."""
    s = make(num_blocks=4096, block_size=BLOCK, **cfg)
    rng = random.Random(0)
    s.cost = StepCostModel()
    for _ in range(64):
        s.cost.observe(*synthetic_step(rng.choice([1, 16, 128, 512]), rng.randrange(0, 1000), rng))
    return s


def prompt_tokens(batch) -> int:
    return sum(n for r, n in zip(batch.requests, batch.num_new_tokens, strict=True) if n > 1)


def start_streams(s, count: int, prompt_len: int = 20) -> list:
    reqs = [request(f"stream{i}", prompt_len) for i in range(count)]
    for r in reqs:
        s.add(r)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs):
        run_step(s)
    run_step(s)  # one decode: the streams' burst closed, a prompt added now arrives after it
    return reqs


def test_prompt_chunks_keep_decoding_steps_within_the_target():
    s = scheduler(max_itl_ms=40)
    start_streams(s, 16)
    long = request("long", 2000)
    s.add(long)
    steps = 0
    while long.num_computed_tokens < long.num_prompt_tokens:
        batch = run_step(s)
        steps += 1
        assert sum(n == 1 for n in batch.num_new_tokens) >= 16, "a stream skipped a step"
        assert s.cost.predict(batch.shape) <= 0.040 or prompt_tokens(batch) <= BLOCK
        assert prompt_tokens(batch) % BLOCK == 0 or long.num_computed_tokens == long.num_prompt_tokens
        assert steps < 200, "the long prompt stalled"
    # 8 ms + 16 decodes leave about 95 prompt tokens a step, in whole blocks: 80.
    assert steps == -(-2000 // 80) and s.num_limited_chunks == steps - 1


def test_without_a_target_chunks_fill_the_token_budget():
    s = scheduler(max_itl_ms=0)
    start_streams(s, 16)
    s.add(request("long", 2000))
    assert prompt_tokens(run_step(s)) == s.token_budget - 16
    assert s.num_limited_chunks == 0


def test_no_limit_while_nothing_decodes():
    """A step with no running stream stalls no one: the prompt takes the whole budget."""
    s = scheduler(max_itl_ms=10)
    s.add(request("alone", 5000))
    assert prompt_tokens(run_step(s)) == s.token_budget


def test_no_limit_until_the_cost_model_has_a_fit():
    s = make(num_blocks=4096, block_size=BLOCK, max_itl_ms=10)
    start_streams(s, 4)
    s.add(request("long", 5000))
    assert not s.cost.ready and prompt_tokens(run_step(s)) == s.token_budget - 4


def test_prompts_always_move_even_when_decodes_alone_pass_the_target():
    s = scheduler(max_itl_ms=5)  # under the 8 ms a step costs with nothing in it
    start_streams(s, 8)
    waiting = [request(f"w{i}", 100) for i in range(3)]
    for r in waiting:
        s.add(r)
    steps = 0
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in waiting) and steps < 100:
        assert prompt_tokens(run_step(s)) <= BLOCK  # one block, to one prompt, per step
        steps += 1
    # Bounded waits: each prompt takes ceil(100 / 16) = 7 steps, one after another.
    assert steps == 3 * 7


def test_the_default_target_is_twice_a_full_batch_of_decodes():
    s = scheduler(max_num_seqs=32)
    streams = start_streams(s, 4)
    s.add(request("long", 2000))
    batch = run_step(s)
    context = streams[0].num_computed_tokens - 1  # where each stream's decoded token was
    full = StepShape(32, 32 * (context + 1))
    limit = 2 * s.cost.predict(full)
    assert s.cost.predict(batch.shape) <= limit < s.cost.predict(batch.shape.plus(2000, BLOCK))


def test_a_burst_of_prompts_over_a_few_streams_is_taken_at_the_full_budget():
    """Prompts arriving while as few streams decode: one step takes them all; the streams still decode in it."""
    s = scheduler()  # the automatic target
    streams = start_streams(s, 2)
    burst = [request(f"b{i}", 500) for i in range(2 * BURST_PROMPTS_PER_STREAM)]
    for r in burst:
        s.add(r)
    batch = run_step(s)  # 1,000 prompt tokens: several times what the target lets beside two decodes
    assert all(r in batch.requests for r in streams + burst)
    assert prompt_tokens(batch) == 500 * len(burst) and s.num_limited_chunks == 0


def _burst_over_three_steps(s) -> tuple[int, bool]:
    """12 prompts of 200 tokens at a 1,024-token budget: the steps until all are prefilled, and whether every
    step but the last took the whole budget."""
    burst = [request(f"b{i}", 200) for i in range(12)]
    for r in burst:
        s.add(r)
    steps, full = 0, True
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in burst) and steps < 100:
        batch = run_step(s)
        steps += 1
        full &= batch.total_tokens == 1024 or not s.waiting
    return steps, full


def test_by_default_a_burst_ends_once_its_own_streams_outnumber_its_prompts():
    s = scheduler(max_num_batched_tokens=1024)
    steps, full = _burst_over_three_steps(s)  # the third step: 10 streams, 2 prompts
    assert steps > 3 and not full and s.num_limited_chunks > 0


def test_a_held_burst_lasts_until_its_last_prompt_is_prefilled():
    """A burst bigger than a step: its first prompts decode while the rest prefill, and do not make them wait
    on the target; a prompt arriving once the burst is done, with more streams decoding, is held to it again."""
    s = scheduler(max_num_batched_tokens=1024, hold_bursts=True)
    assert _burst_over_three_steps(s) == (3, True) and s.num_limited_chunks == 0
    late = request("late", 1000)
    s.add(late)
    run_step(s)
    assert 0 < late.num_computed_tokens < 1000 and s.num_limited_chunks == 1


def test_prompts_arriving_during_a_held_bursts_first_step_join_it_and_later_ones_do_not():
    s = scheduler(max_num_batched_tokens=4096, hold_bursts=True)
    for i in range(6):
        s.add(request(f"b{i}", 200))
    run_step(s)  # the whole burst, prefilled in one step
    stragglers = [request(f"s{i}", 500) for i in range(2)]
    for r in stragglers:
        s.add(r)
    batch = run_step(s)  # 2 prompts against 6 streams, yet in the burst: taken whole
    assert all(r.num_computed_tokens == 500 for r in stragglers) and s.num_limited_chunks == 0
    assert batch.total_tokens == 6 + 1000
    late = request("late", 500)
    s.add(late)
    run_step(s)
    assert late.num_computed_tokens < 500 and s.num_limited_chunks == 1


def test_fewer_prompts_than_streams_keep_the_target_and_a_hand_set_target_ignores_bursts():
    s = scheduler()
    start_streams(s, 2)
    for i in range(2 * BURST_PROMPTS_PER_STREAM - 1):
        s.add(request(f"w{i}", 1000))
    limit = s._step_limit(StepShape(2, 2 * 21))
    batch = run_step(s)
    assert s.cost.predict(batch.shape) <= limit and s.num_limited_chunks == 1
    hand_set = scheduler(max_itl_ms=40)
    start_streams(hand_set, 2)
    for i in range(4 * BURST_PROMPTS_PER_STREAM):
        hand_set.add(request(f"w{i}", 1000))
    assert hand_set._step_limit(StepShape(2, 2 * 21), burst=True) == 0.040
    assert prompt_tokens(run_step(hand_set)) < 1000 and hand_set.num_limited_chunks > 0
