"""Times a few forward passes at start-up, so the step cost model predicts from the first loaded step.

Online, the cost model learns from the engine's own steps, but the first burst of prompts arrives before it
has seen steps of different sizes: without a fit nothing limits the prompt chunks, and the first streams
stall behind full-budget steps. vLLM likewise runs a dummy forward pass at start-up (to size its KV cache).

The passes run on scratch requests whose blocks are freed uncommitted: nothing enters the prefix cache, no KV
event is sent, no counter moves.
"""

import logging
import time
from typing import TYPE_CHECKING

from kvyard.engine.request import Request
from kvyard.engine.scheduler import ScheduledBatch
from kvyard.engine.step_cost import StepShape
from kvyard.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvyard.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

DECODE_CONTEXT = 128  # where the calibration's decodes sit: a short chat's length
# The largest prompt timed: the cost is linear in tokens, and the chunks stall-free batching sizes are a few
# hundred tokens, so a larger budget's whole-budget prompt would only lengthen every server's start.
MAX_CALIBRATION_TOKENS = 512


def calibration_batches(token_budget: int, max_num_seqs: int) -> list[list[tuple[int, int]]]:
    """Batches as (start position, new tokens) per request: prompts of the whole budget, a quarter and a
    sixteenth of it, a quarter-budget chunk deep into a prompt (attention over more keys), and decode batches
    of a quarter and all of `max_num_seqs`."""
    quarter = max(1, token_budget // 4)
    return [
        [(0, token_budget)],
        [(0, quarter)],
        [(0, max(1, token_budget // 16))],
        [(token_budget, quarter)],
        [(DECODE_CONTEXT, 1)] * max(1, max_num_seqs // 4),
        [(DECODE_CONTEXT, 1)] * max_num_seqs,
    ]


def calibrate_step_cost(engine: "LLMEngine", rounds: int = 2) -> None:
    """Time each calibration batch `rounds` times; every round but the first (which builds kernels' caches and
    primitives) goes into the cost model."""
    tokens = min(engine.scheduler.token_budget, MAX_CALIBRATION_TOKENS)
    batches = calibration_batches(tokens, engine.cfg.max_num_seqs)
    started = time.perf_counter()
    for round_ in range(rounds):
        for spans in batches:
            seconds, shape = _time_batch(engine, spans)
            if shape is not None and round_ > 0:
                engine.scheduler.cost.observe(shape, seconds)
    cost = engine.scheduler.cost
    if cost.ready:
        fixed, per_token, _ = cost.coefficients
        log.info("step cost model: %.1f ms a step + %.3f ms a token (calibrated in %.1f s)",
                 1000 * fixed, 1000 * per_token, time.perf_counter() - started)


def _time_batch(engine: "LLMEngine", spans: list[tuple[int, int]]) -> tuple[float, StepShape | None]:
    blocks = engine.blocks
    if any(start + n > engine.max_model_len for start, n in spans):
        return 0.0, None  # a short context: calibrate with what fits
    batch = ScheduledBatch()
    scratch = []
    try:
        for i, (start, n) in enumerate(spans):
            req = Request(f"calibration-{i}", [1] * (start + n), SamplingParams(max_tokens=1))
            if not blocks.can_fit(req, start + n):
                return 0.0, None  # a small pool: calibrate with what fits
            req.num_computed_tokens = start
            blocks.grow(req, start + n)
            batch.add(req, n)
            scratch.append(req)
        t0 = time.perf_counter()
        engine.runner.execute(engine.runner.prepare(batch))
        return time.perf_counter() - t0, batch.shape
    finally:
        for req in scratch:
            blocks.free(req)
