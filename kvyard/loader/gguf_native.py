"""GGUF's own blocks kept as they are, for `--quantization gguf`: no dequantizing, no second rounding.

Four common GGUF types are, value for value, kvyard low-bit forms that its kernels run:
- Q4_0, Q4_1, Q4_K store groups of 32 inputs as 4-bit codes n in 0..15 with a float scale and offset,
  w = scale * n + offset (Q4_0: offset -8 * scale; Q4_1: an fp16 offset; Q4_K: 6-bit scales and minimums
  under an fp16 pair per 256 values). That is `int4-g32-min`.
- Q8_0 stores groups of 32 as int8 codes under an fp16 scale: int8 with groups of 32 (`int8-g32`).
So the layers load into the low-bit kernels with the file's own weights, at the file's own size.

The codes are taken from the blocks directly. Rounding the dequantized weights afresh would not give them
back: a block's codes need not span 0..15, so its minimum and maximum are not the grid's (Qwen2.5-Coder's
Q4_K re-rounded to int4-g32-min measured KL 0.055 in session 16).
"""

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor
from gguf.quants import Q4_K

from kvyard.quant.qtensor import QuantizedTensor
from kvyard.quant.scheme import WeightScheme

GROUP = 32
INT4 = WeightScheme(bits=4, group_size=GROUP, symmetric=False, float_zero=True)  # int4-g32-min
INT8 = WeightScheme(bits=8, group_size=GROUP)  # int8-g32
_Q = GGMLQuantizationType
SCHEMES = {_Q.Q4_0: INT4, _Q.Q4_1: INT4, _Q.Q4_K: INT4, _Q.Q8_0: INT8}
_CODE_OFFSET = 8  # kvyard's int4 codes are signed, -8..7

RowPermutation = Callable[[np.ndarray], np.ndarray]


def _f16(raw: np.ndarray) -> np.ndarray:
    """[blocks, 2] bytes -> [blocks, 1] float32."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """[blocks, bytes] -> [blocks, 2 * bytes] codes. Each run of `run` bytes holds 2 * run values: the low
    nibbles are the first `run`, the high nibbles the next `run`."""
    b = qs.reshape(qs.shape[0], -1, 1, run) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (b & np.uint8(0x0F)).reshape(qs.shape[0], -1)


def _blocks(data: np.ndarray, qtype: _Q) -> np.ndarray:
    return np.asarray(data, dtype=np.uint8).reshape(-1, GGML_QUANT_SIZES[qtype][1])


def int4_groups(data: np.ndarray, qtype: _Q) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw Q4_0/Q4_1/Q4_K blocks -> (codes uint8 [values], scale, offset float32 [values / 32]) in the tensor's
    order: w = scale * codes + offset per group of 32."""
    blocks = _blocks(data, qtype)
    if qtype == _Q.Q4_0:  # d (fp16), 16 bytes of codes; w = d * (n - 8)
        scale = _f16(blocks[:, :2])
        offset, codes = -8 * scale, _nibbles(blocks[:, 2:], 16)
    elif qtype == _Q.Q4_1:  # d, m (fp16), 16 bytes of codes; w = d * n + m
        scale, offset, codes = _f16(blocks[:, :2]), _f16(blocks[:, 2:4]), _nibbles(blocks[:, 4:], 16)
    elif qtype == _Q.Q4_K:  # d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 of codes
        sc, mins = Q4_K.get_scale_min(blocks[:, 4:16])
        scale = _f16(blocks[:, :2]) * sc.astype(np.float32)
        offset = -(_f16(blocks[:, 2:4]) * mins.astype(np.float32))
        codes = _nibbles(blocks[:, 16:], 32)
    else:
        raise ValueError(f"{qtype.name} is not a 4-bit type with groups of {GROUP}")
    return codes.reshape(-1), scale.reshape(-1), offset.reshape(-1)


def int8_groups(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Raw Q8_0 blocks (d fp16, 32 int8 codes; w = d * q) -> (codes int8 [values], scale float32 [values / 32])."""
    blocks = _blocks(data, _Q.Q8_0)
    return np.ascontiguousarray(blocks[:, 2:]).view(np.int8).reshape(-1), _f16(blocks[:, :2]).reshape(-1)


def as_int4(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> QuantizedTensor:
    """codes [N, K] (0..15), scale and offset [N, K / 32] -> int4-g32-min, w = (q - zero_point) * scale.

    A group whose scale is 0 is the constant `offset`; it becomes codes -8 with scale `offset` (1 when the
    offset is 0 too) and zero point -9 (-8), which dequantize to that constant."""
    flat = scale == 0
    constant = torch.where(offset == 0, torch.ones_like(offset), offset)
    safe_scale = torch.where(flat, constant, scale)
    zero_point = torch.where(flat, torch.where(offset == 0, -8.0, -9.0), -_CODE_OFFSET - offset / safe_scale)
    q = codes.to(torch.int8) - _CODE_OFFSET
    q = torch.where(flat.repeat_interleave(GROUP, dim=1), torch.full_like(q, -_CODE_OFFSET), q)
    return QuantizedTensor(INT4, q.contiguous(), safe_scale.contiguous(), zero_point.float().contiguous())


def read_native(t: ReaderTensor, rows_permuted: RowPermutation | None = None) -> QuantizedTensor:
    """One GGUF tensor of a type in SCHEMES as its kvyard form, in HF layout ([out, in]; rows un-permuted by
    `rows_permuted` where the converter permuted them)."""
    n, k = (int(d) for d in reversed(t.shape.tolist()))
    if t.tensor_type == _Q.Q8_0:
        codes, scale = int8_groups(t.data)
        parts = [codes.reshape(n, k), scale.reshape(n, k // GROUP)]
    else:
        codes, scale, offset = int4_groups(t.data, t.tensor_type)
        parts = [codes.reshape(n, k), scale.reshape(n, k // GROUP), offset.reshape(n, k // GROUP)]
    if rows_permuted is not None:
        parts = [rows_permuted(p) for p in parts]
    tensors = [torch.from_numpy(np.ascontiguousarray(p)) for p in parts]
    if t.tensor_type == _Q.Q8_0:
        return QuantizedTensor(INT8, tensors[0], tensors[1])
    return as_int4(*tensors)
