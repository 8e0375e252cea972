"""This machine's rates, measured rather than assumed, for `kvyard plan --hardware this` (#38).

- memory bandwidth: the best of a few reductions over a buffer far larger than the caches;
- bf16 FLOPs: the best of a few matmuls the size of a batched prefill (2,048 rows), on the torch threads;
- the fixed cost of a decode step is what the calibration fits from measured engines (kvyard bench plan).
Each figure is the best of its repeats: a VM's stalls slow single runs, never speed them up.
"""

import time
from dataclasses import replace

import torch

from kvyard.plan.hardware import Device, this_machine

BUFFER_BYTES = 512 * 2**20
REPEATS = 5


def _best_seconds(fn, repeats: int = REPEATS) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm: pages touched, kernels chosen
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def memory_bandwidth(buffer_bytes: int = BUFFER_BYTES) -> float:
    """Bytes/s read by a sum over a float32 buffer of `buffer_bytes`."""
    x = torch.ones(buffer_bytes // 4, dtype=torch.float32)
    return buffer_bytes / _best_seconds(lambda: x.sum())


def matmul_flops(m: int = 2048, k: int = 2048, n: int = 2048, dtype: torch.dtype = torch.bfloat16) -> float:
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    return 2 * m * k * n / _best_seconds(lambda: a @ b)


def measured_this_machine() -> Device:
    dev = this_machine()
    return replace(dev, bandwidth=memory_bandwidth(), flops={"bfloat16": matmul_flops()},
                   note=dev.note + ", measured")
