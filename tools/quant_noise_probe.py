"""How sensitive a model is to weight error: KL against the source when every quantizable weight (LM head
excluded) is replaced by a perturbed copy, both models in the same dtype.

usage: python tools/quant_noise_probe.py MODEL DTYPE [PROBES]
PROBES (comma list, default all): int8 (per channel, as shipped), int8-asym, int8-g128, int8-g32 (per-group
int8: not a shipped scheme), bf16 (the weights rounded to bf16), noiseR (Gaussian, std R x the row's max |w|).
The weights are rounded and put back dense, so the figures are the rounding alone, whatever the kernels.
"""
import sys

import torch
from quant_rounding_kl import HELD_OUT  # the same held-out passages (this script's folder is on sys.path)

from kvyard.models.decoder import DecoderModel
from kvyard.quant.calib import build_calibration
from kvyard.quant.fidelity import FidelityMeter
from kvyard.quant.plan import DEFAULT_PROTECT, is_protected, linear_units
from kvyard.quant.qtensor import QuantizedTensor
from kvyard.quant.scheme import WeightScheme
from kvyard.quant.tool import QuantizeOptions, Reference, load_reference

PROBES = "int8,int8-asym,int8-g128,int8-g32,bf16,noise3e-4,noise1e-3"


def perturbation(probe: str):
    if probe == "bf16":
        return lambda w: w.bfloat16().float()
    if probe.startswith("noise"):
        r = float(probe.removeprefix("noise"))
        gen = torch.Generator().manual_seed(0)
        return lambda w: w + torch.randn(w.shape, generator=gen) * w.abs().amax(1, keepdim=True) * r
    group = int(probe.removeprefix("int8-g")) if probe.startswith("int8-g") else None
    scheme = WeightScheme(bits=8, group_size=group, symmetric=probe != "int8-asym")
    return lambda w: QuantizedTensor.quantize(w, scheme).dequantize()


def reference_and_held_out(model: str, dtype: str) -> tuple[Reference, FidelityMeter]:
    """The unquantized model with its calibration meter, and a meter on the held-out passages."""
    torch.set_num_threads(2)
    ref = load_reference(QuantizeOptions(model=model, scheme="int8", dtype=dtype, progress=False))
    return ref, FidelityMeter(ref.model, build_calibration(ref.ckpt.tokenizer, HELD_OUT, 256).sequences[: len(HELD_OUT)])


def measure(ref: Reference, held: FidelityMeter, tensors: dict[str, torch.Tensor], label: str) -> None:
    """Print the KL of a model built from `tensors` against `ref`, on the calibration set and on held-out text."""
    perturbed = DecoderModel(ref.ckpt.config, ref.model.dtype, torch.device("cpu"), max_positions=257)
    perturbed.load(tensors.items(), "probe")
    with torch.inference_mode():
        a, b = ref.meter.measure(perturbed), held.measure(perturbed)
    print(f"{label} calibration KL {a.kl_mean:.2e} (top-1 {a.top1_agreement:.3f}) | "
          f"held-out KL {b.kl_mean:.2e} (top-1 {b.top1_agreement:.3f})", flush=True)


def main() -> None:
    ref, held = reference_and_held_out(sys.argv[1], sys.argv[2])
    members = [m for u in linear_units(ref.ckpt.config) if not is_protected(u, DEFAULT_PROTECT) for m in u.members]
    for probe in (sys.argv[3] if len(sys.argv) > 3 else PROBES).split(","):
        change = perturbation(probe)
        tensors = dict(ref.tensors)
        for m in members:
            tensors[m + ".weight"] = change(tensors[m + ".weight"].float())
        measure(ref, held, tensors, f"{probe:12s}")


if __name__ == "__main__":
    main()
