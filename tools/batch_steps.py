"""Where a 32-request offline batch spends its time: prefill steps and decode steps, timed step by step.

usage: python tools/batch_steps.py [ROUNDS]        one engine (LLM defaults), ROUNDS batches after a warm-up
       python tools/batch_steps.py [ROUNDS] --ab   two engines in one process, KVYARD_AMX=1 and 0, taking turns
                                                   batch by batch (the AMX matmuls against oneDNN's)

Workload: 32 requests of random tokens, 128 in and 64 out, greedy, EOS ignored (kvyard bench offline's).
Each batch also reports the process's minor page faults (KVYARD_KEEP_FREED_MEMORY=0 shows glibc's defaults).
"""
import os
import resource
import statistics
import sys
import time

import torch

from kvyard.bench.workload import random_workload
from kvyard.engine.llm_engine import LLMEngine
from kvyard.llm import LLM
from kvyard.sampling_params import SamplingParams


def run_batch(eng: LLMEngine, seed: int) -> tuple[float, float, float, int]:
    """(total s, prefill s, median decode step s, minor page faults) for one batch."""
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for prompt in random_workload(eng.tokenizer, 32, 128, 64, seed=seed).prompts:
        eng.add_request(prompt, params)
    prefill, decode = [], []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    while eng.has_unfinished_requests():
        s = eng.scheduler
        in_prefill = bool(s.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running)
        t = time.perf_counter()
        eng.step()
        (prefill if in_prefill else decode).append(time.perf_counter() - t)
    elapsed = time.perf_counter() - start
    return elapsed, sum(prefill), statistics.median(decode), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 3
    torch.set_num_threads(2)
    engines = {}
    for name, flag in (("amx", "1"), ("onednn", "0")) if "--ab" in sys.argv else (("kvyard", os.environ.get("KVYARD_AMX", "1")),):
        os.environ["KVYARD_AMX"] = flag  # read when the weights are arranged at load
        engines[name] = LLM("smollm2-135m").engine
    results: dict[str, list[tuple[float, float, float, int]]] = {name: [] for name in engines}
    for r in range(rounds + 1):
        order = list(engines.items()) if r % 2 == 0 else list(reversed(engines.items()))
        for name, eng in order:
            timing = run_batch(eng, seed=r)
            if r > 0:  # the first round warms up
                results[name].append(timing)
    for name, rows in results.items():
        cells = ", ".join(f"{t:.2f} s (prefill {p:.2f} s, decode step {d * 1e3:.1f} ms, {f} page faults)"
                          for t, p, d, f in rows)
        print(f"{name}: {cells}")


if __name__ == "__main__":
    main()
