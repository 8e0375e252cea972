"""How fast SmolLM2's 30 layers of bf16 weights stream through oneDNN's packed GEMM at a few row counts.

usage: python tools/gemm_stream.py   (distinct weights per layer, so nothing stays in cache between layers)
"""
import statistics
import time

import torch

from kvyard.models.decoder import linear, pack_weight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down


def main() -> None:
    torch.set_num_threads(2)
    layers = [[pack_weight(torch.randn(o, i, dtype=torch.bfloat16)) for o, i in SHAPES] for _ in range(30)]
    nbytes = 30 * sum(o * i * 2 for o, i in SHAPES)
    for rows in (1, 16, 32):
        xs = {i: torch.randn(rows, i, dtype=torch.bfloat16) for i in (576, 1536)}
        times = []
        for _ in range(7):
            start = time.perf_counter()
            for layer in layers:
                for w, (_, i) in zip(layer, SHAPES, strict=True):
                    linear(xs[i], w)
            times.append(time.perf_counter() - start)
        t = statistics.median(times)
        print(f"{rows} rows: {t * 1e3:.2f} ms for 30 layers, {nbytes / t / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
