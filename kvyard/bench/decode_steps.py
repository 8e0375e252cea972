"""Timing decode steps in isolation: prefill a batch first, then time the steps that follow."""

import time

from kvyard.llm import LLM
from kvyard.sampling_params import SamplingParams


def timed_decode_steps(llm: LLM, prompts: list, params: SamplingParams, steps: int) -> list[float]:
    """Seconds of each of up to `steps` engine steps while every request of the batch is decoding.

    The requests are added together, stepped until each has its first token (prefill done), timed
    until one finishes or `steps` is reached, then aborted so that the engine is empty again.
    """
    return interleaved_decode_steps({"": llm}, prompts, params, steps)[""]


def interleaved_decode_steps(llms: dict[str, LLM], prompts: list, params: SamplingParams,
                             steps: int) -> dict[str, list[float]]:
    """Seconds of each decode step of every engine, the engines taking turns step by step over the same prompts
    (as timed_decode_steps does for one).

    A paired design for a noisy machine: a slow spell hits every engine within a few steps, rather than one
    engine's whole block of steps, so the ratios of the per-step times hold even when the absolute times drift.
    """
    running = {name: _decoding(llm, prompts, params) for name, llm in llms.items()}
    times: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(steps):
        if any(r.finished for _, reqs in running.values() for r in reqs):
            break
        for name, llm in llms.items():
            start = time.perf_counter()
            llm.engine.step()
            times[name].append(time.perf_counter() - start)
    for name, llm in llms.items():
        _abort(llm, running[name][0])
    return times


def _decoding(llm: LLM, prompts: list, params: SamplingParams) -> tuple[list[str], list]:
    """The prompts' requests added and stepped until each has its first token (prefill done): their ids and
    requests."""
    eng = llm.engine
    ids = [eng.add_request(p, params) for p in prompts]
    reqs = [eng._tracked[i].req for i in ids]
    while any(r.num_output_tokens == 0 for r in reqs):
        eng.step()
    return ids, reqs


def _abort(llm: LLM, ids: list[str]) -> None:
    """Abort what is left of the timed requests, so that the engine is empty again."""
    for i in ids:
        if i in llm.engine._tracked:
            llm.engine.abort_request(i)
    llm.engine.step()


def decode_token_rate(llm: LLM, prompts: list, params: SamplingParams, steps: int) -> float:
    """Tokens a second that the batch's requests gain over up to `steps` engine steps once every one of them is
    decoding. Counted, not taken as batch / step time: with pipeline stages overlapping, a step carries one
    micro-batch, not the whole batch."""
    ids, reqs = _decoding(llm, prompts, params)
    before, start = sum(r.num_output_tokens for r in reqs), time.perf_counter()
    for _ in range(steps):
        if any(r.finished for r in reqs):
            break
        llm.engine.step()
    rate = (sum(r.num_output_tokens for r in reqs) - before) / (time.perf_counter() - start)
    _abort(llm, ids)
    return rate
