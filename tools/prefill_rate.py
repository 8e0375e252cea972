"""Prefill tokens/s of a bf16 model with its prefill-sized matmuls on MKL's fp32 GEMM (widened values; what
kvyard does where oneDNN has no bf16 GEMM) against PyTorch's bf16 GEMM, in one process, taking turns.

usage: python tools/prefill_rate.py MODEL [PROMPTS] [LEN] [ROUNDS]
       python tools/prefill_rate.py smollm2-135m 4 512 3
Each round prefills PROMPTS new random prompts of LEN tokens (one output token each) once per route. On a CPU
with a bf16 GEMM both routes are the same one.
"""
import statistics
import sys
import time

import torch

from kvyard.bench.workload import random_workload
from kvyard.config import EngineConfig
from kvyard.kernels import fp32_gemm
from kvyard.llm import LLM
from kvyard.sampling_params import SamplingParams


def main() -> None:
    model = sys.argv[1]
    prompts, length, rounds = (int(a) for a in (sys.argv[2:] + ["4", "512", "3"][len(sys.argv) - 2:])[:3])
    torch.set_num_threads(2)
    llm = LLM(config=EngineConfig(model=model, dtype="bfloat16", kv_cache_memory="1GiB"))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    has_no_bf16_gemm = fp32_gemm.no_bf16_gemm
    routes = {"fp32 GEMM": has_no_bf16_gemm, "bf16 GEMM": lambda: False}
    llm.generate(random_workload(llm.tokenizer, 1, length, 1, seed=-1).prompts, params)  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in routes}
    for r in range(rounds):
        for i, (name, route) in enumerate(routes.items()):
            fp32_gemm.no_bf16_gemm = route  # type: ignore[assignment]
            # fresh prompts every time: a prompt seen before would be served from the prefix cache
            work = random_workload(llm.tokenizer, prompts, length, 1, seed=r * len(routes) + i)
            start = time.perf_counter()
            llm.generate(work.prompts, params)
            rates[name].append(work.input_tokens / (time.perf_counter() - start))
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.0f} tok/s" for n, v in rates.items()), flush=True)
    fp32_gemm.no_bf16_gemm = has_no_bf16_gemm  # type: ignore[assignment]
    med = {name: statistics.median(v) for name, v in rates.items()}
    ratios = [round(a / b, 2) for a, b in zip(rates["fp32 GEMM"], rates["bf16 GEMM"], strict=True)]
    print(f"{model}: fp32 GEMM {med['fp32 GEMM']:.0f} tok/s, bf16 GEMM {med['bf16 GEMM']:.0f} tok/s, "
          f"{med['fp32 GEMM'] / med['bf16 GEMM']:.2f}x (rounds {ratios}); no bf16 GEMM here: {has_no_bf16_gemm()}")


if __name__ == "__main__":
    main()
