"""Decode attention alone, on a real engine state: ROWS rows of SmolLM2 ~PROMPT + STEPS tokens in, all 30 layers.

usage: python tools/decode_attention_time.py [KV_CACHE_DTYPE] [STEPS] [ROWS] [PROMPT]   (auto or int8, default 30
       decode steps before the timed one, 32 rows, 128-token prompts; KVYARD_CPU_KERNELS=0 times the gather + SDPA
       path)
"""
import statistics
import sys
import time

import torch

import kvyard.kernels.cpu as cpu_kernels
import kvyard.models.attention as attention
from kvyard.bench.workload import random_workload
from kvyard.llm import LLM
from kvyard.sampling_params import SamplingParams


def main() -> None:
    torch.set_num_threads(2)
    kv_dtype = sys.argv[1] if len(sys.argv) > 1 else "auto"
    steps, rows, prompt_len = (int(a) for a in (sys.argv[2:] + ["30", "32", "128"][len(sys.argv[2:]):]))
    eng = LLM("smollm2-135m", kv_cache_dtype=kv_dtype).engine
    for prompt in random_workload(eng.tokenizer, rows, prompt_len, 64, seed=5).prompts:
        eng.add_request(prompt, SamplingParams(max_tokens=steps + 10, temperature=0, ignore_eos=True))
    for _ in range(steps):
        eng.step()
    captured = []
    run = attention.decode_attention
    cpu_kernels.decode_stack_enabled = lambda: False  # the captured step goes layer by layer, through `capture`

    def capture(q, cache, meta):
        captured.append((q.clone(), cache, meta))
        return run(q, cache, meta)

    attention.decode_attention = capture
    eng.step()
    attention.decode_attention = run
    times = []
    for _ in range(15):
        start = time.perf_counter()
        for q, cache, meta in captured:
            run(q, cache, meta)
        times.append(time.perf_counter() - start)
    lens = captured[0][2].decode_lens
    print(f"KV cache {kv_dtype}: {len(captured)} layers, {q.shape[0]} rows, {int(lens.min())}-{int(lens.max())} tokens: "
          f"{statistics.median(times) * 1e3:.2f} ms per step (median of 15)")


if __name__ == "__main__":
    main()
