"""Linear layers on CPU: a weight's fastest resident form, chosen once at load, and the one call that runs it.

A dense bf16 weight is held in one of two pre-arranged forms, so that no matmul rearranges it per call:
- `VnniWeight`, VNNI blocks of 32 columns for kvyard's own kernels, where the CPU has AMX (csrc/amx_linear.cpp)
  or AVX512-BF16 (csrc/dpbf16_linear.cpp): a decode step's few rows then stream each weight at close to
  memory speed, at a few microseconds per call (with AMX, prefill-sized calls take the oneDNN copy it keeps
  where steps may carry more than 512 rows; the AVX512-BF16 loop ties oneDNN there and keeps none);
- oneDNN's blocked layout otherwise (torch.ops.mkldnn);
- `RowInvariantWeight` on the batch-invariant path (`--batch-invariant`): the plain matrix, run by one kernel at
  every row count, so that a row's result never depends on the rows that share its call.
Low-bit weights (QuantizedLinear) carry their own kernels; fp32 and GPU weights stay plain.
"""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvyard.errors import ConfigError
from kvyard.kernels import cpu as cpu_kernels
from kvyard.kernels import fp32_gemm, vnni
from kvyard.quant.qlinear import PlainLowBitLinear, QuantizedLinear, VnniLowBitLinear

_PACK_ROWS_HINT = 32  # the layout oneDNN picks for this many rows also serves 1 and 512 rows well
AMX_MAX_ROWS = 512  # up to here the AMX loop is at least as fast as oneDNN (0.9x of its time at 512 rows)


@dataclass(frozen=True)
class VnniWeight:
    """A bf16 [out, in] weight in VNNI blocks (kvyard/kernels/vnni.py), run by kvyard's AMX kernel where the
    CPU has AMX, else by its AVX512-BF16 register kernel.

    `onednn` keeps oneDNN's packed copy for prefill-sized calls on AMX CPUs: above AMX_MAX_ROWS rows the matmul
    is compute-bound and oneDNN's GEMM beats the AMX loop (1.35x faster over SmolLM2's four layer shapes at
    2,048 rows, alternating microbenchmark), at the cost of a second copy of the dense weights.
    """

    blocks: torch.Tensor
    onednn: torch.Tensor | None = None
    # A fused gate|up weight keeps oneDNN's copies of its two halves instead (see gated_mlp_input).
    onednn_halves: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def fits(cls, w: torch.Tensor) -> bool:
        return w.dim() == 2 and vnni.fits(*w.shape)

    @classmethod
    def tile(cls, w: torch.Tensor, onednn: torch.Tensor | None = None,
             onednn_halves: tuple[torch.Tensor, torch.Tensor] | None = None) -> "VnniWeight":
        return cls(vnni.to_blocks(w), onednn, onednn_halves)

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0] * vnni.BLOCK_COLS, self.blocks.shape[1] * 2

    @property
    def nbytes(self) -> int:
        """Resident bytes: the blocks and, where kept, oneDNN's copies."""
        copies = ([self.onednn] if self.onednn is not None else []) + list(self.onednn_halves or ())
        return self.blocks.nbytes + sum(c.nbytes for c in copies)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.onednn is not None and x.shape[0] > AMX_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn, bias, "none", [], "")
        return _vnni_kernel()(x, self.blocks, bias)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """self(x).float() (bf16-rounded values, in fp32 for sampling); the AVX512-BF16 kernel writes them so
        in one pass, where converting Gemma's [32, 262144] logits afterwards took 7.6 ms of a 71 ms step."""
        if _vnni_kernel() is torch.ops.kvyard.dpbf16_linear and (self.onednn is None or x.shape[0] <= AMX_MAX_ROWS):
            return torch.ops.kvyard.dpbf16_linear_f32(x, self.blocks)
        return self(x).float()


@dataclass(frozen=True)
class RowInvariantWeight:
    """A plain bf16 [out, in] weight whose every matmul, at any row count and on any CPU kind, runs kvyard's
    portable kernel (csrc/linear_bf16.cpp, widened_rows.h): each output element is one fp32 sum over the input in
    a fixed order, rounded to bf16 once, whichever rows share the call. oneDNN, MKL and the AMX kernel each choose
    their blocking (and so their order of summation) by the shape of the call; the AVX512-BF16 kernel does not,
    and serves the batch-invariant path itself where it runs (row_invariant)."""

    weight: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.ops.kvyard.linear_bf16(x.contiguous(), self.weight)
        return y if bias is None else y + bias


@functools.cache
def _vnni_kernel():  # looked up once: a decode step makes ~120 of these calls, each ~2 us of Python otherwise
    return torch.ops.kvyard.amx_linear if cpu_kernels.amx_available() else torch.ops.kvyard.dpbf16_linear


class RowInvariantLowBit:
    """A low-bit weight of kvyard's portable kernel (csrc/lowbit_linear.cpp) on the batch-invariant path: every
    call takes the kernel's widened loop (widened_rows.h), whose sums keep one order at any row count. A lone row
    would take its integer path instead, which rounds x to int16 first, so it goes in twice and comes out once
    (a row more of arithmetic over weights the call streams anyway)."""

    def __init__(self, inner: PlainLowBitLinear):
        self.inner = inner
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        return self.inner.kernel(x if rows > 1 else x.expand(2, -1))[:rows]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.inner.dequantize(dtype)


# A linear layer's weight: a dense [out, in] matrix (plain or oneDNN-packed), VNNI blocks, or a low-bit one.
Weight = torch.Tensor | VnniWeight | RowInvariantWeight | RowInvariantLowBit | QuantizedLinear


def row_invariant(w: Weight) -> Weight:
    """`w` for the batch-invariant path: a dense bf16 CPU matrix as VNNI blocks where the AVX512-BF16 kernel runs
    them (one chain per output at every row count: csrc/dpbf16_linear.cpp), else as a RowInvariantWeight; a weight
    of the portable low-bit kernel as a RowInvariantLowBit, and VNNI low-bit blocks as they are where the AVX-512
    kernel runs them without AMX; anything else has no kernel that keeps a row's sums in one order."""
    if isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype == torch.bfloat16 and w.device.type == "cpu":
        if VnniWeight.fits(w) and cpu_kernels.dpbf16_available() and not cpu_kernels.amx_available():
            return VnniWeight.tile(w)
        return RowInvariantWeight(w.contiguous())
    if isinstance(w, PlainLowBitLinear):
        return RowInvariantLowBit(w)
    if keeps_row_order(w):
        return w
    raise ConfigError(f"batch_invariant does not cover a {type(w).__name__} weight: only dense bf16 weights, the "
                      "portable low-bit kernel's (no outlier columns) and VNNI low-bit blocks on AVX-512 CPUs without "
                      "AMX", param="batch_invariant")


def keeps_row_order(w: Weight) -> bool:
    """Whether `w`'s kernel sums each output of a row in one order whatever rows share the call: the row-invariant
    forms, and without AMX the VNNI blocks (bf16: dpbf16_linear; low-bit: vnni_lowbit_linear's bf16 tiles), one
    chain per output at every row count. With AMX both go to AMX tiles, whose blocking follows the call's shape."""
    if isinstance(w, (RowInvariantWeight, RowInvariantLowBit)):
        return True
    return isinstance(w, (VnniWeight, VnniLowBitLinear)) and not cpu_kernels.amx_available()


def packable(w: torch.Tensor) -> bool:
    return (w.dtype == torch.bfloat16 and w.device.type == "cpu" and not w.is_mkldnn
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packed_copies(max_rows: int | None, dtype: torch.dtype = torch.bfloat16) -> int:
    """The rearranged copies pack_weight keeps of a dense weight of `dtype` on this CPU, for shapes VNNI blocks
    fit (0: the weight stays as it is). kvyard plan sizes the weights with it, so that the two never differ."""
    if dtype != torch.bfloat16 or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return 0
    if cpu_kernels.amx_available():
        return 1 if max_rows is not None and max_rows <= AMX_MAX_ROWS else 2
    return 1


def pack_weight(w: Weight, max_rows: int | None = None, gate_up: bool = False) -> Weight:
    """A dense bf16 CPU weight rearranged once for its kernel (same values; results equal within rounding).

    With AMX, oneDNN's copy is kept beside the AMX blocks only if calls may exceed AMX_MAX_ROWS rows
    (`max_rows`: the caller's most rows per call, None if unknown): an engine with a 512-token budget never
    does, so it holds its weights once. A fused gate|up weight (`gate_up`) keeps its two halves there instead.

    Given a plain matrix, oneDNN reorders it on every call: for a decode step, whose matmuls stream every
    weight from memory, that costs ~30% at 32 rows. The AMX kernel beats oneDNN's packed GEMM by ~1.4x over
    SmolLM2's 121 decode matmuls at 32 rows and ~1.5x at one row (python tools/gemm_stream.py).
    """
    if not isinstance(w, torch.Tensor) or not packable(w):
        return w
    if VnniWeight.fits(w) and cpu_kernels.amx_available():
        if packed_copies(max_rows) == 1:
            return VnniWeight.tile(w)
        if gate_up:
            gate, up = w.chunk(2)
            return VnniWeight.tile(w, onednn_halves=(_onednn_layout(gate), _onednn_layout(up)))
        return VnniWeight.tile(w, _onednn_layout(w))
    if VnniWeight.fits(w) and cpu_kernels.dpbf16_available():
        return VnniWeight.tile(w)
    return _onednn_layout(w)


def _onednn_layout(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), _PACK_ROWS_HINT)


def gated_mlp_input(x: torch.Tensor, gate_up: Weight) -> torch.Tensor | None:
    """silu(x @ gate.T) * (x @ up.T) for a prefill-sized x, from oneDNN's copies of the two halves, with the
    activation and the product applied to the GEMMs' fp32 results as they are written (oneDNN post-ops);
    None where `gate_up` keeps no halves or x is small (the caller takes linear, then silu_mul).

    At 2,048 rows the gate|up output (12 MB for SmolLM2) stays in no cache, so a separate silu_mul pass over
    it cost about as much as the fusion saves: the MLP took 0.81x of the time (6.05 against 7.5 ms a layer,
    alternating microbenchmark). Each product is rounded once, from fp32 (silu_mul rounds gate and up first).
    """
    if not isinstance(gate_up, VnniWeight) or gate_up.onednn_halves is None or x.shape[0] <= AMX_MAX_ROWS:
        return None
    gate, up = gate_up.onednn_halves
    activated = torch.ops.mkldnn._linear_pointwise(x, gate, None, "swish", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, activated, up, None, "mul")


FEW_ROWS = 64  # rows up to which kvyard's bf16 kernel takes a plain bf16 weight (a decode step's, not a prefill's)


@functools.cache
def plain_bf16_cpu() -> bool:
    """True where kvyard's kernels build and oneDNN has no bf16 GEMM, so bf16 weights stay plain matrices."""
    return cpu_kernels.available() and fp32_gemm.no_bf16_gemm()


def linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(w, VnniWeight):
        return w(x, b)
    if not isinstance(w, torch.Tensor):
        y = w(x)
        return y if b is None else y + b
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and w.dtype == torch.bfloat16 and x.dim() == 2:
        if x.shape[0] <= FEW_ROWS and w.is_contiguous() and plain_bf16_cpu():
            # Where oneDNN has no bf16 GEMM, PyTorch's generic one ran a 32-row decode step at a third of the
            # speed of kvyard's few-row kernel (csrc/linear_bf16.cpp), whose one-row path also streams faster
            # than torch.mv. Past 64 rows MKL's fp32 GEMM on the widened values catches up with it (SmolLM2's
            # four layer shapes on a 2-core AMD EPYC: kvyard 2.0x MKL at 32 rows, 1.3x at 48, 1.06x at 64, 1.05x
            # at 96, 0.97x at 128), and is 5-7x the generic bf16 loop at 128-512 rows.
            y = torch.ops.kvyard.linear_bf16(x.contiguous(), w)
        elif x.shape[0] == 1:
            # oneDNN's bf16 GEMM on an unpacked weight streams it at about half the speed of GEMV at one row;
            # a batch-1 decode is pure weight streaming, so it takes the matrix-vector path.
            y = torch.mv(w, x[0]).unsqueeze(0)
        elif fp32_gemm.no_bf16_gemm():
            return fp32_gemm.widened_linear(x, w.shape[0], lambda start, end: w[start:end].float(), b)
        else:
            return F.linear(x, w, b)
        return y if b is None else y + b
    return F.linear(x, w, b)
