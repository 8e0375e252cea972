"""Batch-1 decode tokens/s of each model loaded twice in one process, weights on 4 KB pages
(KVYARD_HUGE_PAGES=0) and moved onto huge pages, taking turns round by round.

usage: python tools/huge_pages_rates.py ROUNDS NAME=MODEL [NAME=MODEL ...]
       python tools/huge_pages_rates.py 5 bf16=smollm2-135m int8=bench-results/quant-s13-smollm2/int8
"""
import os
import statistics
import sys

import torch

from kvyard.bench.quant import decode_rate
from kvyard.config import EngineConfig
from kvyard.llm import LLM


def main() -> None:
    rounds = int(sys.argv[1])
    torch.set_num_threads(2)
    engines = {}
    for name, path in (arg.split("=", 1) for arg in sys.argv[2:]):
        for pages in ("4k", "huge"):
            os.environ["KVYARD_HUGE_PAGES"] = "1" if pages == "huge" else "0"  # read at each load
            engines[f"{name}-{pages}"] = LLM(config=EngineConfig(model=path, dtype="bfloat16", kv_cache_memory="1GiB"))
    runs = []
    for r in range(rounds):
        runs.append({key: decode_rate(llm, 1, 128, 32) for key, llm in engines.items()})
        print(f"round {r + 1}: " + ", ".join(f"{k}={v:.1f}" for k, v in runs[-1].items()), flush=True)
    for key in (k for k in engines if k.endswith("-huge")):
        small = key.removesuffix("-huge") + "-4k"
        ratios = [run[key] / run[small] for run in runs]
        print(f"{key}: {statistics.median(run[key] for run in runs):.1f} tok/s against "
              f"{statistics.median(run[small] for run in runs):.1f} on 4 KB pages, {statistics.median(ratios):.3f}x "
              f"(rounds {[round(x, 2) for x in ratios]})")


if __name__ == "__main__":
    main()
