"""The input statistics GPTQ needs: H = 2 X^T X / n of each linear unit, from calibration passes.

Each unit's dense weight is wrapped in a recorder that accumulates X^T X of its inputs and then runs the
weight as before, so the model computes exactly what it computes unrecorded. Fused units (q|k|v,
gate|up) get one Hessian: their rows share the same input.
"""

import torch

from kvyard.models.decoder import DecoderModel
from kvyard.models.linear import Weight, linear
from kvyard.quant.fidelity import batch_logits
from kvyard.quant.plan import Unit

# Sequences per forward pass: bounds the activations held at once on large calibration sets.
PASS_SEQUENCES = 8


class HessianRecorder:
    """Stands in for a dense weight in DecoderModel (which calls any non-tensor weight as w(x))."""

    def __init__(self, weight: Weight):
        self.weight = weight
        self.xtx: torch.Tensor | None = None
        self.rows = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.add(x)
        return linear(x, self.weight)

    def add(self, x: torch.Tensor) -> None:
        xf = x.reshape(-1, x.shape[-1]).float()
        self.xtx = xf.t() @ xf if self.xtx is None else self.xtx.addmm_(xf.t(), xf)
        self.rows += xf.shape[0]

    def hessian(self) -> torch.Tensor:
        if self.xtx is None:
            raise ValueError("no calibration input reached this layer")
        with torch.inference_mode(False):  # a normal tensor, which later code may update in place
            return self.xtx * (2.0 / self.rows)


def _slot(model: DecoderModel, u: Unit) -> tuple[object, str]:
    return (model, "lm_head") if u.layer is None else (model.layers[u.layer], u.attr)


def collect_hessians(model: DecoderModel, units: list[Unit], sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """Unit name -> Hessian [K, K] (float32), from teacher-forced passes of the full model over `sequences`."""
    recorders = {}
    for u in units:
        owner, attr = _slot(model, u)
        recorders[u.name] = HessianRecorder(getattr(owner, attr))
        setattr(owner, attr, recorders[u.name])
    try:
        for i in range(0, len(sequences), PASS_SEQUENCES):
            batch_logits(model, sequences[i:i + PASS_SEQUENCES])
    finally:
        for u in units:
            owner, attr = _slot(model, u)
            setattr(owner, attr, recorders[u.name].weight)
    return {name: r.hessian() for name, r in recorders.items()}
