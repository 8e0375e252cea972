"""Activation-aware weight scaling (AWQ): give input channels with large activations a finer grid.

Round to nearest gives every weight of a row the same absolute error, but an error in a column whose
input channel carries large activations moves the output most. Multiplying column j of a unit's weight
by s_j > 1 before rounding, and dividing input channel j by s_j, shrinks that column's share of the error
at the cost of the others. The division is folded into the op that makes the input, so the model is the
same function in exact arithmetic and the checkpoint keeps its ordinary layout:

- q|k|v: the input RMSNorm weight;   gate|up: the post-attention RMSNorm weight;
- down_proj: the rows of up_proj (silu(gate) * up is linear in up);
- o_proj: the rows of v_proj, one scale per KV channel (query heads sharing a KV head read the same rows).

s = a^alpha, with a_j the RMS of input channel j over the calibration tokens; alpha comes from a grid, per
unit, by the output error left on those tokens, tr(E H E^T) with E the rounding error of the weight and H
the unit's X^T X. One number per unit is fitted, so unlike GPTQ it does not overfit a small calibration set.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvyard.models.config import ModelConfig
from kvyard.quant.plan import Unit
from kvyard.quant.qtensor import QuantizedTensor
from kvyard.quant.scheme import WeightScheme

SCALINGS = ("auto", "awq", "none")  # auto: kvyard.quant.tool.choose_scaling decides on held-back calibration text
DEFAULT_SCALING = "auto"
ALPHAS = tuple(i / 10 for i in range(1, 11))  # alpha = 0 (no scaling) is always a candidate too
# Units whose fold changes another unit's weight go first, so that unit is searched on what it will store.
_ORDER = {"o": 0, "down": 1, "qkv": 2, "gate_up": 3}

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class UnitScaling:
    alpha: float  # 0: left unscaled
    error_ratio: float  # output error with the scaling / without it (<= 1)


def output_error(w: torch.Tensor, w_hat: torch.Tensor, hessian: torch.Tensor) -> float:
    """tr(E H E^T): proportional to the summed squared output error over the calibration inputs."""
    e = (w - w_hat).float()
    return float(((e @ hessian) * e).sum())


def search_scale(w: torch.Tensor, hessian: torch.Tensor, scheme: WeightScheme,
                 tie: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[float, torch.Tensor, float]:
    """(alpha, per-column scale, error ratio) that leaves the least output error after rounding `w`."""
    w = w.float()
    rms = hessian.diagonal().clamp(min=0).sqrt()
    rms = rms.clamp(min=float(rms.max()) * 1e-6 + 1e-12)  # dead channels must not get a zero scale

    def error(s: torch.Tensor) -> float:
        return output_error(w, QuantizedTensor.quantize(w * s, scheme).dequantize() / s, hessian)

    ones = torch.ones_like(rms)
    base = error(ones)
    best = (0.0, ones, base)
    for alpha in ALPHAS:
        s = rms ** alpha
        s = tie(s) if tie is not None else s
        s = s / (s.max() * s.min()).sqrt()  # centred on 1, so the row maxima stay in range
        err = error(s)
        if err < best[2]:
            best = (alpha, s, err)
    return best[0], best[1], best[2] / base if base > 0 else 1.0


def _by_kv_head(cfg: ModelConfig, s: torch.Tensor) -> torch.Tensor:
    """o_proj's input channels as [KV head, query head of its group, channel]."""
    return s.view(cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim)


def _kv_tie(cfg: ModelConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """One scale per KV channel for o_proj's input: the mean over the query heads of a group."""
    def tie(s: torch.Tensor) -> torch.Tensor:
        grouped = _by_kv_head(cfg, s)
        return grouped.mean(1, keepdim=True).expand_as(grouped).reshape(-1)

    return tie


def _divide_rows(tensors: Tensors, name: str, s: torch.Tensor) -> None:
    tensors[name + ".weight"] = tensors[name + ".weight"] / s.unsqueeze(1)
    if name + ".bias" in tensors:
        tensors[name + ".bias"] = tensors[name + ".bias"] / s


def fold(tensors: Tensors, cfg: ModelConfig, unit: Unit, s: torch.Tensor) -> None:
    """Scale the unit's columns by s and divide its input by s where that input is made (in place)."""
    for m in unit.members:
        tensors[m + ".weight"] = tensors[m + ".weight"] * s
    p = f"model.layers.{unit.layer}."
    if unit.attr == "qkv":
        tensors[p + "input_layernorm.weight"] = tensors[p + "input_layernorm.weight"] / s
    elif unit.attr == "gate_up":
        tensors[p + "post_attention_layernorm.weight"] = tensors[p + "post_attention_layernorm.weight"] / s
    elif unit.attr == "down":
        _divide_rows(tensors, p + "mlp.up_proj", s)
    elif unit.attr == "o":
        _divide_rows(tensors, p + "self_attn.v_proj", _by_kv_head(cfg, s)[:, 0].reshape(-1))
    else:
        raise ValueError(f"no op to fold the scale of {unit.name} into")


def scale_units(tensors: Tensors, cfg: ModelConfig, units: list[Unit], hessians: dict[str, torch.Tensor],
                scheme: WeightScheme, progress: Callable[[list[Unit]], list[Unit]] = list) -> tuple[Tensors, dict[str, UnitScaling]]:
    """A copy of `tensors` with every decoder-layer unit scaled and folded; the LM head is left alone."""
    out = dict(tensors)
    chosen: dict[str, UnitScaling] = {}
    ordered = sorted((u for u in units if u.layer is not None), key=lambda u: (u.layer, _ORDER[u.attr]))
    for u in progress(ordered):
        w = torch.cat([out[m + ".weight"].float() for m in u.members])
        alpha, s, ratio = search_scale(w, hessians[u.name], scheme, _kv_tie(cfg) if u.attr == "o" else None)
        if alpha > 0:
            fold(out, cfg, u, s)
        chosen[u.name] = UnitScaling(alpha, ratio)
    return out, chosen
