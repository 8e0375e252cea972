"""Low-bit linear layers: kvyard's AMX kernel where the CPU has AMX, else PyTorch's own int8/int4 CPU kernels.

A batch-1 decode step streams every weight from memory once, so it runs at the speed of the bytes read:
int8 halves them and int4 quarters them, and the kernels below read them without dequantizing.
Those kernels are tuned for few rows, though; a prefill chunk of hundreds of rows is compute-bound
and runs several times faster by dequantizing the weight once and taking the dense GEMM.
"""

import functools
from typing import Protocol

import torch
import torch.nn.functional as F

from kvyard.errors import ConfigError
from kvyard.kernels import cpu as cpu_kernels
from kvyard.kernels import fp32_gemm, vnni
from kvyard.quant.qtensor import QuantizedTensor

# Above this many rows, dequantize-then-GEMM beats the low-bit kernels on this CPU
# (SmolLM2 layer shapes on this 2-core Xeon: at 32 rows the kernels win 2-3x, at 512 rows they lose 4-14x).
KERNEL_MAX_ROWS = 64
_INT4_TILE = 64  # output rows are padded to whole tiles of the widest packing below
# PyTorch packs int4 weights for its CPU kernel by the instruction set it was dispatched to: in tiles of
# 64 output rows with AVX-512, 32 with AVX2; byte j of a tile's k-th run holds row j in its low nibble and
# row j + tile/2 in its high one.
_INT4_PACKINGS = (64, 32)
_INT4_RUN = 32  # kvyard's portable kernel packs int4 codes in runs of 32 values
_BLOCK_ROWS, _CHUNK_BYTES = 4, 32  # its rows are interleaved in blocks of four, chunks of 32 bytes per row
# The bf16 int8 kernel reads K in steps of 32 and returns garbage (or crashes) on a ragged tail.
_INT8_K_STEP = 32


class QuantizedLinear(Protocol):
    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int: ...


def dequantized_linear(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """A prefill-sized x through the dense GEMM on the dequantized weight. Where bf16 has no GEMM it is the fp32
    one (kernels/fp32_gemm.py), and the weight is then not rounded to bf16 either, as the low-bit kernels never
    round it."""
    if fp32_gemm.takes_fp32_gemm(x):
        w = layer.dequantize(torch.float32)
        return fp32_gemm.widened_linear(x, layer.out_features, lambda start, end: w[start:end])
    return F.linear(x, layer.dequantize(x.dtype))


class OutlierColumns:
    """A low-bit layer whose kernel knows nothing of outlier columns, plus those columns in fp32: the codes are
    zero there, so y = layer(x) + x[:, cols] @ W_c^T (one more small matmul per call)."""

    def __init__(self, inner: "QuantizedLinear", cols: torch.Tensor, outliers: torch.Tensor):
        self.inner = inner
        self.out_features, self.in_features = inner.out_features, inner.in_features
        self.cols, self.weights_t = cols, outliers.t().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (self.inner(x).float() + x[:, self.cols].float() @ self.weights_t.float()).to(x.dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        w = self.inner.dequantize(torch.float32)
        w[:, self.cols] = self.weights_t.t()
        return w.to(dtype)

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes + self.cols.nbytes + self.weights_t.nbytes


def _kernels_available(device: torch.device) -> bool:
    return device.type == "cpu"


class _PaddedInput:
    """Kernels that need K padded: weights get zero columns, and x gets zero columns at call time."""

    in_features: int
    k_pad: int

    def _pad_x(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.k_pad == self.in_features else F.pad(x, (0, self.k_pad - self.in_features))


class _ScaledCodes:
    """What the low-bit forms with codes `q`, fp32 scales and zero terms share (kvyard's two, and PyTorch's int8):
    the zero term and their bytes."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None

    @staticmethod
    def _zero_term(qt: QuantizedTensor) -> torch.Tensor | None:
        """w = (q - zp) * scale = q * scale + zero, so zero = -zp * scale, [N, groups]."""
        return None if qt.zero_point is None else -qt.zero_point.float() * qt.scale

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes + (0 if self.zero is None else self.zero.nbytes)


class Int8Linear(_ScaledCodes, _PaddedInput):
    """int8 weight: y = (x @ q.T) * scale, per output channel; grouped scales or zero points (GGUF's Q8_0, Q5_0,
    Q5_1) dequantize instead, as PyTorch's kernel takes one scale per channel and no zero point. Scales stay fp32
    (a GGUF's are exact there); the kernel gets its per-channel copy in the model's dtype."""

    def __init__(self, qt: QuantizedTensor, dtype: torch.dtype, device: torch.device):
        self.out_features, self.in_features = qt.shape
        self.group_size = qt.group_size
        self.k_pad = -(-self.in_features // _INT8_K_STEP) * _INT8_K_STEP
        self.q = F.pad(qt.q, (0, self.k_pad - self.in_features)).contiguous().to(device)
        self.scale = qt.scale.float().contiguous().to(device)  # [N, groups]
        zero = self._zero_term(qt)
        self.zero = None if zero is None else zero.to(device)
        per_channel = self.scale.shape[1] == 1 and self.zero is None
        self.channel_scale = self.scale[:, 0].to(dtype).contiguous() if per_channel and _kernels_available(device) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.channel_scale is not None and x.shape[0] <= KERNEL_MAX_ROWS:
            return torch.ops.aten._weight_int8pack_mm(self._pad_x(x).contiguous(), self.q,
                                                      self.channel_scale.to(x.dtype))
        return dequantized_linear(self, x)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return _scaled(self.q[:, : self.in_features].float(), self.scale, self.zero, self.group_size, dtype)


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
        return dequantized_linear(self, x)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in `dtype`, unpacked from the kernel layout (so no second copy is kept)."""
        u = _unpack_int4(self.packed, self.n_pad, self.k_pad, _int4_packing())
        sz = self.scale_zero.to(dtype).repeat_interleave(self.group_size, dim=0)  # [k_pad, n_pad, 2]
        w = (u.to(dtype) - 8) * sz[..., 0].t() + sz[..., 1].t()
        return w[: self.out_features, : self.in_features]

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale_zero.nbytes


def _unpack_int4(packed: torch.Tensor, n: int, k: int, tile: int) -> torch.Tensor:
    """The [n, k] codes of `_convert_weight_to_int4pack_for_cpu`'s output, read as tiles of `tile` rows."""
    tiles = packed.view(n // tile, k, tile // 2)
    return torch.cat([tiles & 0xF, tiles >> 4], dim=-1).transpose(1, 2).reshape(n, k)


@functools.cache
def _int4_packing() -> int:
    """The tile width this PyTorch build packs int4 weights in here: the one that reads a random probe back."""
    codes = torch.randint(0, 16, (_INT4_TILE, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    for tile in _INT4_PACKINGS:
        if torch.equal(_unpack_int4(packed, *codes.shape, tile).to(torch.int32), codes):
            return tile
    raise RuntimeError("PyTorch's CPU int4 packing is neither of the known layouts; int4 weights cannot be read back")


def _scaled(values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int,
            dtype: torch.dtype) -> torch.Tensor:
    """values [N, K] * scale + zero, with scale and zero [N, groups] applied group by group, in `dtype`."""
    k = values.shape[1]
    w = values * scale.repeat_interleave(group, dim=1)[:, :k]
    if zero is not None:
        w = w + zero.repeat_interleave(group, dim=1)[:, :k]
    return w.to(dtype)


class VnniLowBitLinear(_ScaledCodes):
    """int8 (per channel) or int4 (per group) weight in VNNI blocks of 32 output columns (int4: q + 8, two per
    byte), scales and zero terms as [groups, N] fp32, for kvyard's AMX kernel (csrc/amx_lowbit.cpp) or, on
    AVX-512 CPUs without AMX, its register kernel (csrc/vnni_lowbit.cpp). y = sum over groups of scale * (x . q)
    + zero * sum(x), with no rounded weight."""

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
        zero = self._zero_term(qt)
        self.zero = None if zero is None else zero.t().contiguous()
        # outlier columns: indices and their weights in the model's bf16 (the dense model's own values), which
        # both kernels add themselves, block by block, in VNNI pairs [N/32, ceil(C/2), 32, 2] (an odd last column
        # paired with zeros): as [C, N] every block touched C far-apart lines, and SmolLM2's int8 layers with 5 %
        # kept ran 1.6x slower
        self.outlier_cols = qt.outlier_cols
        self.outliers = None if qt.outliers is None else (
            vnni.to_blocks(F.pad(qt.outliers.bfloat16(), (0, qt.outliers.shape[1] % 2))))

    @classmethod
    def fits(cls, qt: QuantizedTensor, dtype: torch.dtype, device: torch.device) -> bool:
        n, k = qt.shape
        return (dtype == torch.bfloat16 and device.type == "cpu" and vnni.fits(n, k) and qt.group_size % 32 == 0
                and (cpu_kernels.amx_available() or cpu_kernels.vnni_lowbit_available()))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Both kernels take every row count. The AVX-512 one widens the codes in registers: 2-10x faster than
        # dequantize-then-GEMM from 64 to 512 rows on a 2-core AMD EPYC (Zen 4), within 1.0-1.3x of the bf16
        # kernel. The AMX one widens each column block once per call: SmolLM2's four layer shapes at 128 rows
        # 1.2-1.35 ms against 12-14 ms dequantized, bf16 1.0 ms (tools/gemm_stream.py --prefill, session 21).
        if x.dtype != torch.bfloat16:
            return dequantized_linear(self, x)
        if _on_amx():
            return torch.ops.kvyard.amx_linear_lowbit(x, self.q, self.scale, self.zero, self.bits, self.group_size,
                                                      self.outlier_cols, self.outliers)
        return torch.ops.kvyard.vnni_lowbit_linear(x, self.q, self.scale, self.zero, self.bits, self.group_size,
                                                   self.outlier_cols, self.outliers)

    def _outlier_weights(self) -> torch.Tensor:
        """The kept columns' weights as [N, C], back from the blocked layout."""
        return vnni.from_blocks(self.outliers)[:, : self.outlier_cols.numel()]  # type: ignore[arg-type,union-attr]

    def _values(self) -> torch.Tensor:
        """q as float32 [N, K], back from the blocked layout."""
        if self.bits == 8:
            return vnni.from_blocks(self.q.float())
        rows = torch.cat([self.q & 0xF, self.q >> 4], dim=-1).float() - 8
        return vnni.from_blocks(rows.view(*self.q.shape[:2], vnni.BLOCK_COLS, 2))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        zero = None if self.zero is None else self.zero.t()
        w = _scaled(self._values(), self.scale.t(), zero, self.group_size, torch.float32)
        if self.outliers is not None:
            w[:, self.outlier_cols] = self._outlier_weights().float()
        return w.to(dtype)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.outliers is None else self.outliers.nbytes + self.outlier_cols.nbytes  # type: ignore[union-attr]
        return super().nbytes + extra



@functools.cache
def _on_amx() -> bool:  # asked once: a decode step makes ~120 low-bit calls
    return cpu_kernels.amx_available()


class PlainLowBitLinear(_ScaledCodes, _PaddedInput):
    """int8 (per channel) or int4 (per group) weight for kvyard's portable kernel (csrc/lowbit_linear.cpp),
    which streams it at close to memory speed for a decode step's rows on CPUs without AMX: q row-major
    (int4: codes q + 8, two per byte, each run of 32 values as 16 bytes with value j low and j + 16 high),
    then cut into chunks of 32 bytes with each block of four rows interleaved chunk by chunk (the kernel reads
    a block's rows together, as one stream). Rows are padded to whole blocks and K to whole chunks with zero
    codes; scales and zero terms [N, groups] fp32, padded alike. Prefill-sized calls dequantize and take the
    dense GEMM.

    `int8_activations` (--dynamic-quant): bf16 calls of two rows or more, prefill included, round x to int8 per run
    of 32 values and take integer dot products (csrc/lowbit_int8_act.cpp); one row keeps the kernel above."""

    def __init__(self, qt: QuantizedTensor, int8_activations: bool = False):
        self.out_features, self.in_features = n, k = qt.shape
        self.int8_activations = int8_activations
        self.bits = qt.scheme.bits
        chunk_values = _CHUNK_BYTES * 8 // self.bits
        self.k_pad = -(-k // chunk_values) * chunk_values
        # int8 per channel is one group per row: the padded row's, as zero codes add nothing
        self.group_size = self.k_pad if qt.scheme.group_size is None else qt.group_size
        n_pad, groups = -(-n // _BLOCK_ROWS) * _BLOCK_ROWS, -(-self.k_pad // self.group_size)
        q = F.pad(qt.q, (0, self.k_pad - k, 0, n_pad - n))
        if self.bits == 4:
            runs = (q + 8).to(torch.uint8).view(n_pad, self.k_pad // _INT4_RUN, 2, _INT4_RUN // 2)
            q = runs[:, :, 0] | (runs[:, :, 1] << 4)
        row_bytes = self.k_pad * self.bits // 8
        blocks = q.reshape(n_pad // _BLOCK_ROWS, _BLOCK_ROWS, row_bytes // _CHUNK_BYTES, _CHUNK_BYTES)
        self.q = blocks.transpose(1, 2).reshape(n_pad, row_bytes).contiguous()

        def padded(t: torch.Tensor) -> torch.Tensor:
            return F.pad(t.float(), (0, groups - t.shape[1], 0, n_pad - n)).contiguous()

        self.scale = padded(qt.scale)
        zero = self._zero_term(qt)
        self.zero = None if zero is None else padded(zero)

    @classmethod
    def fits(cls, qt: QuantizedTensor, dtype: torch.dtype, device: torch.device) -> bool:
        return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
                and (qt.scheme.bits == 8 or qt.group_size % _INT4_RUN == 0) and cpu_kernels.available())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        int8_rows = self.int8_activations and x.dtype == torch.bfloat16  # the integer kernel beats the GEMM at any size
        if int8_rows or (x.shape[0] <= KERNEL_MAX_ROWS and x.dtype in (torch.float32, torch.bfloat16)):
            return self.kernel(x)
        return dequantized_linear(self, x)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x . W^T by kvyard's portable kernel, at any row count (lowbit_linear_i8 itself leaves one row and fp32
        to lowbit_linear)."""
        op = torch.ops.kvyard.lowbit_linear_i8 if self.int8_activations else torch.ops.kvyard.lowbit_linear
        return op(self._pad_x(x).contiguous(), self.q, self.scale, self.zero, self.bits, self.group_size,
                  self.out_features)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        w = torch.ops.kvyard.lowbit_dequantize(self.q, self.scale, self.zero, self.bits, self.group_size)
        return w[: self.out_features, : self.in_features].to(dtype)


def make_linear(qt: QuantizedTensor, dtype: torch.dtype, device: torch.device, row_invariant: bool = False,
                int8_activations: bool = False) -> QuantizedLinear:
    """The fastest low-bit form here: kvyard's VNNI blocks (AMX or AVX-512 kernel), else its portable kernel, else
    PyTorch's own. `row_invariant` (the batch-invariant path): a kernel whose rows never depend on their neighbours,
    the VNNI blocks' AVX-512 kernel where it runs without AMX (bf16 tiles at every row count), else the portable one.
    `int8_activations` (--dynamic-quant): the portable kernel with int8-rounded activations, on every CPU kind alike."""
    inner: QuantizedLinear
    if int8_activations and not (dtype == torch.bfloat16 and cpu_kernels.int8_act_available()):
        raise ConfigError("dynamic_quant needs bf16 and kvyard's AVX2 kernels, which this CPU or build lacks",
                          param="dynamic_quant")
    if not (row_invariant and _on_amx() or int8_activations) and VnniLowBitLinear.fits(qt, dtype, device):
        return VnniLowBitLinear(qt)  # both of its kernels add outlier columns themselves
    if PlainLowBitLinear.fits(qt, dtype, device):
        inner = PlainLowBitLinear(qt, int8_activations)
    else:
        inner = Int8Linear(qt, dtype, device) if qt.scheme.bits == 8 else Int4Linear(qt, dtype, device)
    return inner if qt.outliers is None else OutlierColumns(inner, qt.outlier_cols, qt.outliers)  # type: ignore[arg-type]
