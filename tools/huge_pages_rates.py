"""Batch-1 decode tokens/s of each model loaded twice in one process, weights on 4 KB pages
(KVYARD_HUGE_PAGES=0) and moved onto huge pages, taking turns round by round.

usage: python tools/huge_pages_rates.py ROUNDS NAME=MODEL [NAME=MODEL ...]
       python tools/huge_pages_rates.py 5 bf16=smollm2-135m int8=bench-results/quant-s13-smollm2/int8
"""
import os
import sys

import torch
from quant_decode_rates import paired  # this script's folder is on sys.path

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
        print(f"{key}, huge pages against 4 KB pages: " + paired(runs, key, key.removesuffix("-huge") + "-4k"))


if __name__ == "__main__":
    main()
