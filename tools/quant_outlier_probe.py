"""KL of round-to-nearest weights when each layer's most active input columns are spared, both models in the same
dtype (float32 isolates the weights' rounding): on the calibration set and on the held-out passages of
tools/quant_rounding_kl.py.

usage: python tools/quant_outlier_probe.py MODEL DTYPE FRACTIONS [SCHEME] [MODE]
       python tools/quant_outlier_probe.py smollm2-135m float32 0,0.01,0.02,0.05 int8 exact
MODE exact (default): the columns are kept as they are and left out of the rounding (kvyard quantize
--outlier-columns). MODE scaled: the columns are only scaled up before rounding, as far as no row's largest
weight grows, and scaled back (an AWQ that singles them out), which keeps the plain checkpoint layout.
Columns are ranked by their activation RMS over the calibration set, per unit (q|k|v, o, gate|up, down).
"""
import sys

import torch
from quant_noise_probe import measure, reference_and_held_out  # this script's folder is on sys.path

from kvyard.quant.plan import DEFAULT_PROTECT, is_protected, linear_units
from kvyard.quant.qtensor import QuantizedTensor
from kvyard.quant.scheme import WeightScheme, parse_weight_scheme
from kvyard.quant.tool import outlier_columns


def kept_exact(w: torch.Tensor, cols: torch.Tensor, scheme: WeightScheme) -> torch.Tensor:
    return QuantizedTensor.quantize(w, scheme, cols).dequantize()


def scaled_up(w: torch.Tensor, cols: torch.Tensor, scheme: WeightScheme) -> torch.Tensor:
    rest = w.clone()
    rest[:, cols] = 0
    row_max = rest.abs().amax(1, keepdim=True)
    s = torch.ones(w.shape[1])
    if cols.numel():
        s[cols] = (row_max / w[:, cols].abs().clamp_min(1e-12)).amin(0).clamp_min(1.0)
    return QuantizedTensor.quantize(w * s, scheme).dequantize() / s


def main() -> None:
    fractions = [float(f) for f in sys.argv[3].split(",")]
    scheme = parse_weight_scheme(sys.argv[4] if len(sys.argv) > 4 else "int8")
    spare = scaled_up if len(sys.argv) > 5 and sys.argv[5] == "scaled" else kept_exact
    ref, held = reference_and_held_out(sys.argv[1], sys.argv[2])
    units = [u for u in linear_units(ref.ckpt.config) if not is_protected(u, DEFAULT_PROTECT)]
    for fraction in fractions:
        keep = outlier_columns(ref, units, fraction)
        tensors = dict(ref.tensors)
        for u in units:
            cols = keep.get(u.name, torch.zeros(0, dtype=torch.long))
            for m in u.members:
                tensors[m + ".weight"] = spare(tensors[m + ".weight"].float(), cols, scheme)
        measure(ref, held, tensors, f"{scheme.name}, {fraction:.3f} of input columns spared:")


if __name__ == "__main__":
    main()
