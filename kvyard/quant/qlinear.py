"""Low-bit linear layers: kvyard's AMX kernel where the CPU has AMX, else PyTorch's own int8/int4 CPU kernels.

A batch-1 decode step streams every weight from memory once, so it runs at the speed of the bytes read:
int8 halves them and int4 quarters them, and the kernels below read them without dequantizing.
Those kernels are tuned for few rows, though; a prefill chunk of hundreds of rows is compute-bound
and runs several times faster by dequantizing the weight once and taking the bf16/fp32 GEMM.
"""

from typing import Protocol

import torch
import torch.nn.functional as F

from kvyard.kernels import cpu as cpu_kernels
from kvyard.kernels import vnni
from kvyard.quant.qtensor import QuantizedTensor

# Above this many rows, dequantize-then-GEMM beats the low-bit kernels on this CPU
# (SmolLM2 layer shapes on this 2-core Xeon: at 32 rows the kernels win 2-3x, at 512 rows they lose 4-14x).
KERNEL_MAX_ROWS = 64
_INT4_TILE = 64  # the CPU int4 kernel packs 64 output rows per tile: row r low nibble, row r+32 high
# The bf16 int8 kernel reads K in steps of 32 and returns garbage (or crashes) on a ragged tail.
_INT8_K_STEP = 32


class QuantizedLinear(Protocol):
    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int: ...


def _kernels_available(device: torch.device) -> bool:
    return device.type == "cpu"


class _PaddedInput:
    """Kernels that need K padded: weights get zero columns, and x gets zero columns at call time."""

    in_features: int
    k_pad: int

    def _pad_x(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.k_pad == self.in_features else F.pad(x, (0, self.k_pad - self.in_features))


class Int8Linear(_PaddedInput):
    """Per-output-channel int8 weight: y = (x @ q.T) * scale."""

    def __init__(self, qt: QuantizedTensor, dtype: torch.dtype, device: torch.device):
        self.out_features, self.in_features = qt.shape
        self.k_pad = -(-self.in_features // _INT8_K_STEP) * _INT8_K_STEP
        self.q = F.pad(qt.q, (0, self.k_pad - self.in_features)).contiguous().to(device)
        self.scale = qt.scale[:, 0].to(device=device, dtype=dtype).contiguous()
        self.use_kernel = _kernels_available(device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel and x.shape[0] <= KERNEL_MAX_ROWS:
            return torch.ops.aten._weight_int8pack_mm(self._pad_x(x).contiguous(), self.q, self.scale.to(x.dtype))
        return F.linear(x, self.dequantize(x.dtype))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.q[:, : self.in_features].to(dtype) * self.scale.to(dtype).unsqueeze(1)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


class Int4Linear(_PaddedInput):
    """Group-wise int4 weight in the CPU kernel's packed layout, with per-group scale and zero."""

    def __init__(self, qt: QuantizedTensor, dtype: torch.dtype, device: torch.device):
        self.out_features, self.in_features = qt.shape
        self.group_size = qt.group_size
        n, k = qt.shape
        groups = qt.scale.shape[1]
        # The kernel needs whole tiles of rows and whole groups of columns: pad with zero weights
        # (and pad x with zero columns at call time) so any shape runs.
        self.n_pad, self.k_pad = -(-n // _INT4_TILE) * _INT4_TILE, groups * self.group_size
        u = F.pad(qt.q.to(torch.int32) + 8, (0, self.k_pad - k, 0, self.n_pad - n), value=8)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.contiguous(), 1).to(device)
        # Kernel convention: w = (u - 8) * scale + zero, so an integer zero point zp becomes -zp * scale.
        zero = torch.zeros_like(qt.scale) if qt.zero_point is None else -qt.zero_point.float() * qt.scale
        scale_zero = torch.stack([qt.scale, zero], dim=-1)  # [n, groups, 2]
        scale_zero = F.pad(scale_zero, (0, 0, 0, 0, 0, self.n_pad - n), value=1.0)
        self.scale_zero = scale_zero.transpose(0, 1).contiguous().to(device=device, dtype=dtype)
        self.use_kernel = _kernels_available(device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel and x.shape[0] <= KERNEL_MAX_ROWS:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                self._pad_x(x).contiguous(), self.packed, self.group_size, self.scale_zero.to(x.dtype)
            )
            return y if self.n_pad == self.out_features else y[:, : self.out_features]
        return F.linear(x, self.dequantize(x.dtype))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in `dtype`, unpacked from the kernel layout (so no second copy is kept)."""
        tiles = self.packed.view(self.n_pad // _INT4_TILE, self.k_pad, _INT4_TILE // 2)
        u = torch.cat([tiles & 0xF, tiles >> 4], dim=-1).transpose(1, 2).reshape(self.n_pad, self.k_pad)
        sz = self.scale_zero.to(dtype).repeat_interleave(self.group_size, dim=0)  # [k_pad, n_pad, 2]
        w = (u.to(dtype) - 8) * sz[..., 0].t() + sz[..., 1].t()
        return w[: self.out_features, : self.in_features]

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale_zero.nbytes


class AmxLowBitLinear:
    """int8 (per channel) or int4 (per group) weight for kvyard's AMX kernel (csrc/amx_lowbit.cpp): q in
    VNNI blocks of 32 output columns (int4: q + 8, two per byte), scales and zero terms as [groups, N] fp32.
    y = sum over groups of scale * (x . q) + zero * sum(x): the exact fp32 result, no rounded weight."""

    def __init__(self, qt: QuantizedTensor):
        self.out_features, self.in_features = n, k = qt.shape
        self.bits, self.group_size = qt.scheme.bits, qt.group_size
        blocks = vnni.to_blocks(qt.q)
        if self.bits == 8:
            self.q = blocks
        else:
            rows = (blocks + 8).to(torch.uint8).reshape(n // vnni.BLOCK_COLS, k // 2, 2 * vnni.BLOCK_COLS)
            self.q = (rows[..., : vnni.BLOCK_COLS] | (rows[..., vnni.BLOCK_COLS :] << 4)).contiguous()
        self.scale = qt.scale.t().contiguous()
        # w = (q - zp) * scale = q * scale + zero, zero = -zp * scale
        self.zero = None if qt.zero_point is None else (-qt.zero_point.float() * qt.scale).t().contiguous()

    @classmethod
    def fits(cls, qt: QuantizedTensor, dtype: torch.dtype, device: torch.device) -> bool:
        n, k = qt.shape
        return (dtype == torch.bfloat16 and device.type == "cpu" and vnni.fits(n, k)
                and qt.group_size % 32 == 0 and cpu_kernels.amx_available())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= KERNEL_MAX_ROWS and x.dtype == torch.bfloat16:
            return torch.ops.kvyard.amx_linear_lowbit(x, self.q, self.scale, self.zero, self.bits, self.group_size)
        return F.linear(x, self.dequantize(x.dtype))

    def _values(self) -> torch.Tensor:
        """q as float32 [N, K], back from the blocked layout."""
        if self.bits == 8:
            return vnni.from_blocks(self.q.float())
        rows = torch.cat([self.q & 0xF, self.q >> 4], dim=-1).float() - 8
        return vnni.from_blocks(rows.view(*self.q.shape[:2], vnni.BLOCK_COLS, 2))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        k = self.in_features
        w = self._values() * self.scale.t().repeat_interleave(self.group_size, dim=1)[:, :k]
        if self.zero is not None:
            w = w + self.zero.t().repeat_interleave(self.group_size, dim=1)[:, :k]
        return w.to(dtype)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes + (0 if self.zero is None else self.zero.nbytes)


def make_linear(qt: QuantizedTensor, dtype: torch.dtype, device: torch.device) -> QuantizedLinear:
    if AmxLowBitLinear.fits(qt, dtype, device):
        return AmxLowBitLinear(qt)
    return Int8Linear(qt, dtype, device) if qt.scheme.bits == 8 else Int4Linear(qt, dtype, device)
