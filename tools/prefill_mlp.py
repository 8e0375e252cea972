"""A prefill step's MLP for one SmolLM2 layer at 2,048 rows: silu(gate) * up as oneDNN post-ops on the two
halves of gate|up (what an engine with 2,048-token steps runs) against gate|up, then kvyard's silu_mul,
alternating round by round over the same weights and input.

usage: python tools/prefill_mlp.py [ROWS]
"""
import statistics
import sys
import time

import torch

from kvyard.models.decoder import silu_mul
from kvyard.models.linear import gated_mlp_input, linear, pack_weight


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    torch.set_num_threads(2)
    gate_up = (torch.randn(3072, 576) / 24).bfloat16()
    down = pack_weight((torch.randn(576, 1536) / 40).bfloat16())
    fused, whole = pack_weight(gate_up, gate_up=True), pack_weight(gate_up)
    x = torch.randn(rows, 576).bfloat16()
    if gated_mlp_input(x, fused) is None:
        sys.exit("the fused form needs a CPU with AMX and more than 512 rows")
    forms = {
        "post-ops on the halves": lambda: linear(gated_mlp_input(x, fused), down),
        "gate|up, then silu_mul": lambda: linear(silu_mul(linear(x, whole)), down),
    }
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(22):
        for name, run in forms.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    print(f"{rows} rows: " + ", ".join(f"{name} {statistics.median(t[2:]) * 1e3:.2f} ms" for name, t in times.items()))


if __name__ == "__main__":
    main()
