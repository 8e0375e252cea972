"""Decode tokens/s of saved checkpoints against the first one, taking turns step by step, as `kvyard bench
quant` times them (the same `decode_rates`), without quantizing anything again.

usage: python tools/quant_decode_rates.py BATCHES ROUNDS NAME=MODEL[@QUANTIZATION] [NAME=MODEL ...]
       python tools/quant_decode_rates.py 1,32 5 bf16=smollm2-135m int8=bench-results/quant-s11-smollm2/int8
       python tools/quant_decode_rates.py 1,32 5 bf16=smollm2-135m gguf=smollm2-135m@gguf
(`@QUANTIZATION` loads MODEL with EngineConfig.quantization, e.g. `@gguf` or `@int8`.)
Prints each round, then the medians and each scheme's ratio to the first (per round and of the medians).
"""
import statistics
import sys

import torch

from kvyard.bench.quant import decode_rates
from kvyard.config import EngineConfig
from kvyard.llm import LLM


def batches_rounds_engines(argv: list[str]) -> tuple[list[int], int, dict[str, LLM]]:
    """BATCHES ROUNDS NAME=MODEL[@QUANTIZATION] ...: the batch sizes, the rounds, and one bf16 engine per model."""
    torch.set_num_threads(2)
    engines = {}
    for name, spec in (arg.split("=", 1) for arg in argv[2:]):
        path, _, quantization = spec.partition("@")
        engines[name] = LLM(config=EngineConfig(model=path, dtype="bfloat16", kv_cache_memory="1GiB",
                                                quantization=quantization or None))
    return [int(b) for b in argv[0].split(",")], int(argv[1]), engines


def paired(runs: list[dict[str, float]], key: str, base: str) -> str:
    """'A tok/s against B, R x (rounds [...])': the medians of `key` and `base` over the rounds, and the median of
    their per-round ratios (each round measured both under the same conditions)."""
    ratios = [run[key] / run[base] for run in runs]
    return (f"{statistics.median(run[key] for run in runs):.1f} tok/s against {statistics.median(run[base] for run in runs):.1f}, "
            f"{statistics.median(ratios):.2f}x (rounds {[round(x, 2) for x in ratios]})")


def main() -> None:
    batches, rounds, engines = batches_rounds_engines(sys.argv[1:])
    base = next(iter(engines))
    runs = []
    for r in range(rounds):
        runs.append({f"{name}.b{b}": rate for b in batches for name, rate in decode_rates(engines, b, 128, 32).items()})
        print(f"round {r + 1}: " + ", ".join(f"{k}={v:.1f}" for k, v in runs[-1].items()), flush=True)
    for b in batches:
        med = {name: statistics.median(run[f"{name}.b{b}"] for run in runs) for name in engines}
        for name in engines:
            per_round = [round(run[f"{name}.b{b}"] / run[f"{base}.b{b}"], 2) for run in runs]
            print(f"b{b} {name}: {med[name]:.1f} tok/s, {med[name] / med[base]:.2f}x {base} (rounds {per_round})")


if __name__ == "__main__":
    main()
