"""Timing decode steps in isolation: prefill a batch first, then time the steps that follow."""

import time

from kvyard.llm import LLM
from kvyard.sampling_params import SamplingParams


def timed_decode_steps(llm: LLM, prompts: list, params: SamplingParams, steps: int) -> list[float]:
    """Seconds of each of up to `steps` engine steps while every request of the batch is decoding.

    The requests are added together, stepped until each has its first token (prefill done), timed
    until one finishes or `steps` is reached, then aborted so that the engine is empty again.
    """
    eng = llm.engine
    ids = [eng.add_request(p, params) for p in prompts]
    reqs = [eng._tracked[i].req for i in ids]
    while any(r.num_output_tokens == 0 for r in reqs):
        eng.step()
    times = []
    while len(times) < steps and not any(r.finished for r in reqs):
        start = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - start)
    for i in ids:
        if i in eng._tracked:
            eng.abort_request(i)
    eng.step()  # report the aborts, free the blocks
    return times
