"""Linear layers on CPU: a weight's fastest resident form, chosen once at load, and the one call that runs it.

A dense bf16 weight is held in one of two pre-arranged forms, so that no matmul rearranges it per call:
- `AmxWeight`, tiled for kvyard's AMX kernel (csrc/amx_linear.cpp), where the CPU has AMX: a decode
  step's few rows then stream each weight at close to memory speed, at a few microseconds per call;
- oneDNN's blocked layout otherwise (torch.ops.mkldnn).
Low-bit weights (QuantizedLinear) carry their own kernels; fp32 and GPU weights stay plain.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvyard.kernels import cpu as cpu_kernels
from kvyard.quant.qlinear import QuantizedLinear

_TILE_COLS, _TILE_K = 16, 32  # one AMX B tile: 16 output columns x 32 input values
_PACK_ROWS_HINT = 32  # the layout oneDNN picks for this many rows also serves 1 and 512 rows well


@dataclass(frozen=True)
class AmxWeight:
    """A bf16 [out, in] weight as AMX B tiles: [out/16, in/32, 16, 32], each 32-value k slice of 16 columns
    one contiguous 1 KB tile with the k pairs interleaved (the order TDPBF16PS reads)."""

    tiles: torch.Tensor

    @classmethod
    def fits(cls, w: torch.Tensor) -> bool:
        return w.dim() == 2 and w.shape[0] % _TILE_COLS == 0 and w.shape[1] % _TILE_K == 0

    @classmethod
    def tile(cls, w: torch.Tensor) -> "AmxWeight":
        n, k = w.shape
        pairs = w.reshape(n // _TILE_COLS, _TILE_COLS, k // _TILE_K, _TILE_K // 2, 2)
        return cls(pairs.permute(0, 2, 3, 1, 4).reshape(n // _TILE_COLS, k // _TILE_K, _TILE_K // 2, _TILE_K).contiguous())

    @property
    def shape(self) -> tuple[int, int]:
        return self.tiles.shape[0] * _TILE_COLS, self.tiles.shape[1] * _TILE_K

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.kvyard.amx_linear(x, self.tiles, bias)


# A linear layer's weight: a dense [out, in] matrix (plain or oneDNN-packed), AMX tiles, or a low-bit one.
Weight = torch.Tensor | AmxWeight | QuantizedLinear


def packable(w: torch.Tensor) -> bool:
    return (w.dtype == torch.bfloat16 and w.device.type == "cpu" and not w.is_mkldnn
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(w: Weight) -> Weight:
    """A dense bf16 CPU weight rearranged once for its kernel (same values; results equal within rounding).

    Given a plain matrix, oneDNN reorders it on every call: for a decode step, whose matmuls stream every
    weight from memory, that costs ~30% at 32 rows. AMX tiles beat oneDNN's packed GEMM by 1.6x over
    SmolLM2's 121 decode matmuls at 32 rows and 1.6x at one row (python tools/gemm_stream.py).
    """
    if not isinstance(w, torch.Tensor) or not packable(w):
        return w
    if AmxWeight.fits(w) and cpu_kernels.amx_available():
        return AmxWeight.tile(w)
    return torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS_HINT)


def linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(w, AmxWeight):
        return w(x, b)
    if not isinstance(w, torch.Tensor):
        y = w(x)
        return y if b is None else y + b
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    # oneDNN's bf16 GEMM on an unpacked weight streams it at about half the speed of GEMV at one row;
    # a batch-1 decode is pure weight streaming, so it takes the matrix-vector path.
    if x.shape[0] == 1 and x.dtype == torch.bfloat16 and x.device.type == "cpu":
        y = torch.mv(w, x[0]).unsqueeze(0)
        return y if b is None else y + b
    return F.linear(x, w, b)
