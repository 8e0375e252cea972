"""GPTQ over a whole model, one decoder layer at a time, each layer seeing the quantized layers before it.

A layer's Hessians come from the inputs it receives when every earlier layer is already quantized, as
in GPTQ: the rounding error a layer's GPTQ leaves in the directions its calibration inputs rarely use
would otherwise be amplified by the shifted inputs the quantized earlier layers give it.
The hidden states of all calibration tokens are kept between layers, so each layer runs twice (once
dense to record its inputs, once quantized to make the next layer's inputs) instead of the whole model.
"""

from collections.abc import Callable

import torch

from kvyard.models.decoder import DecoderModel, LayerWeights, rms_norm
from kvyard.quant.fidelity import PrefillBatch
from kvyard.quant.hessian import PASS_SEQUENCES, HessianRecorder
from kvyard.quant.plan import Unit
from kvyard.quant.qlinear import make_linear
from kvyard.quant.qtensor import QuantizedTensor

# unit, its Hessian -> the unit's quantized members, by HF name
QuantizeUnit = Callable[[Unit, torch.Tensor], dict[str, QuantizedTensor]]


def _run_layer(model: DecoderModel, layer: LayerWeights, x: torch.Tensor, batch: PrefillBatch) -> torch.Tensor:
    """The residual stream after `layer`, computed in place in `x`."""
    cos, sin = model.rope.lookup(batch.positions, model.dtype)
    return model.run_layer(x, layer, batch.caches[0], batch.meta, cos, sin)


def sequential_gptq(model: DecoderModel, units: list[Unit], sequences: list[list[int]],
                    quantize_unit: QuantizeUnit) -> dict[str, QuantizedTensor]:
    """Quantize `units` layer by layer; the model is left with its dense weights, as it came."""
    batches = [PrefillBatch.build(model, sequences[i:i + PASS_SEQUENCES], layers=1)
               for i in range(0, len(sequences), PASS_SEQUENCES)]
    out: dict[str, QuantizedTensor] = {}
    with torch.inference_mode():
        xs = [torch.nn.functional.embedding(b.ids, model.embed) for b in batches]
        for i, layer in enumerate(model.layers):
            mine = [u for u in units if u.layer == i]
            dense = {u.attr: getattr(layer, u.attr) for u in mine}
            recorders = {u.name: HessianRecorder(dense[u.attr]) for u in mine}
            for u in mine:
                setattr(layer, u.attr, recorders[u.name])
            for x, b in zip(xs, batches, strict=True):
                _run_layer(model, layer, x.clone(), b)  # only to record the inputs: x stays as it was
            hessians = {name: r.hessian() for name, r in recorders.items()}
            for u in mine:
                with torch.inference_mode(False):
                    members = quantize_unit(u, hessians[u.name])
                out.update(members)
                fused = QuantizedTensor.cat([members[m] for m in u.members])
                setattr(layer, u.attr, make_linear(fused, model.dtype, model.device))
            xs = [_run_layer(model, layer, x, b) for x, b in zip(xs, batches, strict=True)]
            for attr, w in dense.items():
                setattr(layer, attr, w)
        head = [u for u in units if u.layer is None]
        if head:
            rec = HessianRecorder(model.lm_head)
            for x in xs:
                rec.add(rms_norm(x, model.final_norm, model.cfg.rms_norm_eps))
            with torch.inference_mode(False):
                out.update(quantize_unit(head[0], rec.hessian()))
    return out
