"""Prefill tokens/s of low-bit models with their prefill chunks on the low-bit kernel (what kvyard does since
session 21) against the weight dequantized to bf16 for the dense GEMM on every call (what it did on AMX CPUs
before), and of the bf16 model beside them, all in one process, taking turns.

usage: python tools/lowbit_prefill_rate.py BF16_MODEL LOWBIT_DIR [LOWBIT_DIR ...] [--prompts 4] [--len 512]
                                           [--rounds 3] [--kernel-only]
       python tools/lowbit_prefill_rate.py smollm2-135m bench-results/quant-s19-smollm2/int4-g128
Each round prefills new random prompts (one output token each) once per model and route.
"""
import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kvyard.bench.workload import random_workload
from kvyard.config import EngineConfig
from kvyard.llm import LLM
from kvyard.quant import qlinear
from kvyard.sampling_params import SamplingParams

KERNEL = qlinear.VnniLowBitLinear.__call__


def dequantized_over_64_rows(layer: qlinear.VnniLowBitLinear, x: torch.Tensor) -> torch.Tensor:
    return qlinear.dequantized_linear(layer, x) if x.shape[0] > qlinear.KERNEL_MAX_ROWS else KERNEL(layer, x)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bf16_model")
    ap.add_argument("lowbit", nargs="+")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kernel-only", action="store_true", help="leave the dequantized route out")
    args = ap.parse_args()
    torch.set_num_threads(2)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llms = {m: LLM(config=EngineConfig(model=m, dtype="bfloat16", kv_cache_memory="1GiB"))
            for m in [args.bf16_model, *args.lowbit]}
    runs: dict[str, tuple[LLM, Callable]] = {args.bf16_model: (llms[args.bf16_model], KERNEL)}
    for m in args.lowbit:
        runs[f"{m} kernel"] = (llms[m], KERNEL)
        if not args.kernel_only:
            runs[f"{m} dequantized"] = (llms[m], dequantized_over_64_rows)
    for llm in llms.values():  # warm-up
        llm.generate(random_workload(llm.tokenizer, 1, args.len, 1, seed=-1).prompts, params)
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.rounds):
        for i, (name, (llm, call)) in enumerate(runs.items()):
            qlinear.VnniLowBitLinear.__call__ = call  # type: ignore[method-assign]
            # fresh prompts every time: a prompt seen before would be served from the prefix cache
            work = random_workload(llm.tokenizer, args.prompts, args.len, 1, seed=r * len(runs) + i)
            start = time.perf_counter()
            llm.generate(work.prompts, params)
            rates[name].append(work.input_tokens / (time.perf_counter() - start))
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.0f} tok/s" for n, v in rates.items()), flush=True)
    qlinear.VnniLowBitLinear.__call__ = KERNEL  # type: ignore[method-assign]
    base = rates[args.bf16_model]
    for name, v in rates.items():
        ratios = [round(a / b, 2) for a, b in zip(v, base, strict=True)]
        print(f"{name}: {statistics.median(v):.0f} tok/s, {statistics.median(v) / statistics.median(base):.2f}x "
              f"bf16 (rounds {ratios})")


if __name__ == "__main__":
    main()
