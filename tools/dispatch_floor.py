"""What one op call costs from Python before any work: a kvyard custom op against an ATen method, on
tensors small enough that the kernels themselves take well under a microsecond.

usage: python tools/dispatch_floor.py      (one thread; best of 3 runs of 20k calls each)
"""
import time
from collections.abc import Callable

import torch

from kvyard.kernels import cpu as cpu_kernels


def best_us(f: Callable[[], object], n: int = 20000) -> float:
    for _ in range(2000):
        f()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def main() -> None:
    cpu_kernels.amx_available()  # builds and loads the kernels
    torch.set_num_threads(1)
    x, w = torch.randn(1, 576).bfloat16(), torch.ones(576).bfloat16()
    calls = {
        "torch.ops.kvyard.rms_norm": lambda: torch.ops.kvyard.rms_norm(x, w, 1e-5),
        "torch.ops.kvyard.rms_norm.default": lambda: torch.ops.kvyard.rms_norm.default(x, w, 1e-5),
        "torch.ops.aten.add.Tensor": lambda: torch.ops.aten.add.Tensor(x, x),
        "x.add(x)": lambda: x.add(x),
        "a Python call that does nothing": lambda: None,
    }
    for label, f in calls.items():
        print(f"{label:36s} {best_us(f):.2f} us")


if __name__ == "__main__":
    main()
