"""Decode-step time with kvyard's CPU kernels on and off, alternating step by step in one engine.

usage: python tools/kernels_ab.py [ROWS] [BATCHES]   (default 32 rows, 3 batches of 128-in / 64-out prompts)

Steps alternate between the two paths over the same requests, so the VM's speed swings hit both alike;
only pure decode steps with all ROWS requests running are timed. Prints the median step time of each.
"""
import statistics
import sys
import time

import torch

import kvyard.kernels.cpu as cpu_kernels
from kvyard.bench.workload import random_workload
from kvyard.llm import LLM
from kvyard.sampling_params import SamplingParams


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    batches = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    torch.set_num_threads(2)
    assert cpu_kernels.available(), "the CPU kernels did not build"
    eng = LLM("smollm2-135m").engine
    kernels_on = cpu_kernels.available
    times: dict[str, list[float]] = {"kernels": [], "plain": []}
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for b in range(batches):
        for prompt in random_workload(eng.tokenizer, rows, 128, 64, seed=b).prompts:
            eng.add_request(prompt, params)
        i = 0
        while eng.has_unfinished_requests():
            sched = eng.scheduler
            timed = (not sched.waiting and len(sched.running) == rows
                     and all(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running))
            path = "plain" if timed and i % 2 else "kernels"
            cpu_kernels.available = (lambda: False) if path == "plain" else kernels_on
            start = time.perf_counter()
            eng.step()
            if timed:
                times[path].append(time.perf_counter() - start)
                i += 1
        cpu_kernels.available = kernels_on
    on, off = (statistics.median(times[k]) * 1e3 for k in ("kernels", "plain"))
    print(f"{rows} rows: decode step {on:.1f} ms with kernels, {off:.1f} ms without: {off / on:.2f}x "
          f"({len(times['kernels'])} + {len(times['plain'])} steps)")


if __name__ == "__main__":
    main()
