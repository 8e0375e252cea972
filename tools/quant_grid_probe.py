"""Whether int4 can follow the source checkpoint's own 4-bit grid: KL against the source when every quantizable
weight (LM head excluded) is rounded to int4 per group and put back dense, with the group's offset either a float
(its minimum, as GGUF's Q4_1 and Q4_K store it) or kvyard's integer zero point (`int4-gN-asym`), or symmetric.

usage: python tools/quant_grid_probe.py MODEL DTYPE PROBES
PROBES: comma list of KIND:GROUP, KIND one of float, int, sym; e.g. float:32,int:32,float:128,int:128
"""
import sys

import torch
from quant_noise_probe import measure, reference_and_held_out  # this script's folder is on sys.path

from kvyard.quant.plan import DEFAULT_PROTECT, is_protected, linear_units
from kvyard.quant.qtensor import QuantizedTensor
from kvyard.quant.scheme import WeightScheme


def float_offset(w: torch.Tensor, group: int) -> torch.Tensor:
    """w rounded to 16 levels per group between the group's own minimum and maximum (a float offset, no
    integer zero point, and the range need not hold 0); a short last group uses only its own columns."""
    n, k = w.shape
    g = torch.nn.functional.pad(w, (0, -k % group), value=float("nan")).view(n, -1, group)
    lo = g.nan_to_num(nan=float("inf")).amin(-1, keepdim=True)
    hi = g.nan_to_num(nan=float("-inf")).amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    return (((g - lo) / scale).round().clamp(0, 15) * scale + lo).view(n, -1)[:, :k]


def rounded(w: torch.Tensor, kind: str, group: int) -> torch.Tensor:
    if kind == "float":
        return float_offset(w, group)
    return QuantizedTensor.quantize(w, WeightScheme(bits=4, group_size=group, symmetric=kind == "sym")).dequantize()


def main() -> None:
    ref, held = reference_and_held_out(sys.argv[1], sys.argv[2])
    members = [m for u in linear_units(ref.ckpt.config) if not is_protected(u, DEFAULT_PROTECT) for m in u.members]
    for probe in sys.argv[3].split(","):
        kind, group = probe.split(":")
        tensors = dict(ref.tensors)
        for m in members:
            tensors[m + ".weight"] = rounded(tensors[m + ".weight"].float(), kind, int(group))
        measure(ref, held, tensors, f"{probe:10s}")


if __name__ == "__main__":
    main()
