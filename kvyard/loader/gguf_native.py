"""GGUF's own blocks kept as they are, for `--quantization gguf`: no dequantizing, no second rounding.

Six common GGUF types are, value for value, kvyard low-bit forms that its kernels run. Each stores groups of 32
inputs as integer codes q with a float scale and, for some, an offset: w = scale * q (+ offset).
- Q4_0 (w = d * q, q in -8..7): `int4-g32`. Q4_1 (fp16 offset) and Q4_K (6-bit scales and minimums under an
  fp16 pair per 256 values): `int4-g32-min`, the offset as a float zero point.
- Q8_0 (int8 codes) and Q5_0 (5-bit codes, q in -16..15): int8 in groups of 32 (`int8-g32`); Q5_1 (5-bit codes
  and an offset): `int8-g32-min`.
So the layers load into the low-bit kernels with the file's own weights, at the file's own size (5-bit codes
take a byte each: 1.125 bytes a weight against the file's 0.69-0.75 and bf16's 2).

The codes are taken from the blocks directly. Rounding the dequantized weights afresh would not give them
back: a block's codes need not span their range, so its minimum and maximum are not the grid's (Qwen2.5-Coder's
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
INT4 = WeightScheme(bits=4, group_size=GROUP)  # int4-g32
INT4_MIN = WeightScheme(bits=4, group_size=GROUP, symmetric=False, float_zero=True)  # int4-g32-min
INT8 = WeightScheme(bits=8, group_size=GROUP)  # int8-g32
INT8_MIN = WeightScheme(bits=8, group_size=GROUP, symmetric=False, float_zero=True)  # int8-g32-min
_Q = GGMLQuantizationType
SCHEMES = {_Q.Q4_0: INT4, _Q.Q4_1: INT4_MIN, _Q.Q4_K: INT4_MIN, _Q.Q8_0: INT8, _Q.Q5_0: INT8, _Q.Q5_1: INT8_MIN}

RowPermutation = Callable[[np.ndarray], np.ndarray]


def _f16(raw: np.ndarray) -> np.ndarray:
    """[blocks, 2] bytes -> [blocks, 1] float32."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """[blocks, bytes] -> [blocks, 2 * bytes] codes 0..15. Each run of `run` bytes holds 2 * run values: the low
    nibbles are the first `run`, the high nibbles the next `run`."""
    b = qs.reshape(qs.shape[0], -1, 1, run) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (b & np.uint8(0x0F)).reshape(qs.shape[0], -1)


def _five_bit(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5's codes 0..31: the low four bits as in Q4, bit j of the little-endian word `qh` the fifth of value j."""
    high = (np.ascontiguousarray(qh).view("<u4") >> np.arange(GROUP, dtype=np.uint32)) & 1
    return _nibbles(qs, 16) | (high.astype(np.uint8) << 4)


def group_codes(data: np.ndarray, qtype: _Q) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Raw blocks of a type in SCHEMES -> (codes int8 [values], scale float32 [values / 32], offset float32
    [values / 32] or None) in the tensor's order: w = scale * codes (+ offset) per group of 32."""
    blocks = np.asarray(data, dtype=np.uint8).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    d = _f16(blocks[:, :2])
    if qtype == _Q.Q8_0:  # d, 32 int8 codes
        return np.ascontiguousarray(blocks[:, 2:]).view(np.int8).reshape(-1), d.reshape(-1), None
    if qtype == _Q.Q4_0:  # d, 16 bytes of codes n; w = d * (n - 8)
        codes, offset = _nibbles(blocks[:, 2:], 16).astype(np.int8) - 8, None
    elif qtype == _Q.Q4_1:  # d, m, 16 bytes of codes; w = d * n + m = d * (n - 8) + (8 d + m)
        codes, offset = _nibbles(blocks[:, 4:], 16).astype(np.int8) - 8, 8 * d + _f16(blocks[:, 2:4])
    elif qtype == _Q.Q4_K:  # d, dmin, 12 bytes of 6-bit scales and mins, 128 of codes; w = d sc n - dmin m
        sc, mins = Q4_K.get_scale_min(blocks[:, 4:16])
        d = d * sc.astype(np.float32)
        codes = _nibbles(blocks[:, 16:], 32).astype(np.int8) - 8
        offset = 8 * d - _f16(blocks[:, 2:4]) * mins.astype(np.float32)
    elif qtype == _Q.Q5_0:  # d, 4 bytes of fifth bits, 16 of low nibbles; w = d * (n - 16)
        codes, offset = _five_bit(blocks[:, 2:6], blocks[:, 6:]).astype(np.int8) - 16, None
    elif qtype == _Q.Q5_1:  # d, m, fifth bits, low nibbles; w = d * n + m
        codes = _five_bit(blocks[:, 4:8], blocks[:, 8:]).astype(np.int8) - 16
        offset = 16 * d + _f16(blocks[:, 2:4])
    else:
        raise ValueError(f"{qtype.name} has no kvyard form")
    return codes.reshape(-1), d.reshape(-1), None if offset is None else offset.reshape(-1)


def with_offset(scheme: WeightScheme, codes: torch.Tensor, scale: torch.Tensor,
                offset: torch.Tensor | None) -> QuantizedTensor:
    """codes [N, K], scale and offset [N, K / 32] (w = scale * codes + offset) -> kvyard's w = (q - zero_point) *
    scale, the zero point -offset / scale. A group whose scale is 0 is the constant `offset`: it becomes codes 0
    with scale `offset` and zero point -1 (scale 1 and zero point 0 when the offset is 0 too)."""
    if offset is None:
        return QuantizedTensor(scheme, codes.contiguous(), scale.contiguous())
    flat = scale == 0
    safe_scale = torch.where(flat, torch.where(offset == 0, torch.ones_like(offset), offset), scale)
    zero_point = torch.where(flat, torch.where(offset == 0, 0.0, -1.0), -offset / safe_scale)
    q = torch.where(flat.repeat_interleave(GROUP, dim=1), torch.zeros_like(codes), codes)
    return QuantizedTensor(scheme, q.contiguous(), safe_scale.contiguous(), zero_point.float().contiguous())


def read_native(t: ReaderTensor, rows_permuted: RowPermutation | None = None) -> QuantizedTensor:
    """One GGUF tensor of a type in SCHEMES as its kvyard form, in HF layout ([out, in]; rows un-permuted by
    `rows_permuted` where the converter permuted them)."""
    n, k = (int(d) for d in reversed(t.shape.tolist()))
    codes, scale, offset = group_codes(t.data, t.tensor_type)
    parts = [codes.reshape(n, k), scale.reshape(n, k // GROUP)]
    if offset is not None:
        parts.append(offset.reshape(n, k // GROUP))
    if rows_permuted is not None:
        parts = [rows_permuted(p) for p in parts]
    tensors = [torch.from_numpy(np.ascontiguousarray(p)) for p in parts]
    return with_offset(SCHEMES[t.tensor_type], tensors[0], tensors[1], tensors[2] if offset is not None else None)
