"""How fast SmolLM2's 121 decode matmuls stream their bf16 weights: oneDNN's packed GEMM against kvyard's AMX
tiles, alternating round by round over the same weights and inputs.

usage: python tools/gemm_stream.py   (distinct weights per layer, so nothing stays in cache between layers)
"""
import statistics
import time

import torch

from kvyard.kernels import cpu as cpu_kernels
from kvyard.models.linear import AmxWeight, linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
HEAD = (49152, 576)


def main() -> None:
    torch.set_num_threads(2)
    dense = [[torch.randn(o, i, dtype=torch.bfloat16) for o, i in SHAPES] for _ in range(30)]
    dense.append([torch.randn(*HEAD, dtype=torch.bfloat16)])
    forms = {"onednn": [[torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in layer] for layer in dense]}
    if cpu_kernels.amx_available():
        forms["amx"] = [[AmxWeight.tile(w) for w in layer] for layer in dense]
    nbytes = sum(w.numel() * 2 for layer in dense for w in layer)
    for rows in (1, 16, 32, 64):
        xs = {i: torch.randn(rows, i, dtype=torch.bfloat16) for i in (576, 1536)}
        times: dict[str, list[float]] = {name: [] for name in forms}
        for _ in range(7):
            for name, layers in forms.items():
                start = time.perf_counter()
                for layer, src in zip(layers, dense, strict=True):
                    for w, d in zip(layer, src, strict=True):
                        linear(xs[d.shape[1]], w)
                times[name].append(time.perf_counter() - start)
        cells = [f"{name} {statistics.median(t) * 1e3:.2f} ms ({nbytes / statistics.median(t) / 1e9:.1f} GB/s)"
                 for name, t in times.items()]
        print(f"{rows} rows, 121 matmuls: " + ", ".join(cells))


if __name__ == "__main__":
    main()
