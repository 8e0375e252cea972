"""Prefill-sized bf16 matmuls on CPUs where oneDNN has no bf16 GEMM, through MKL's fp32 GEMM.

There (AVX2 without AVX512-BF16 or AMX) `F.linear` on bf16 falls to PyTorch's generic loop: 17-20 GFLOP/s on
a 2-core AMD EPYC for SmolLM2's layer shapes at 128-512 rows, against 120-140 GFLOP/s for the fp32 GEMM over
the same values widened (the widening included; `python tools/gemm_stream.py --prefill`). A product of two
bf16 values is exact in fp32 and both GEMMs sum in fp32, so the result differs from the bf16 GEMM's only by
the order of the sums; it is rounded to bf16 once, as the bf16 GEMM's is.

A dense weight is widened a slab of output rows at a time, so that a large one (a 152k-row LM head) never
needs a full fp32 copy: at most SLAB_BYTES of it exist at once. Low-bit layers (quant/qlinear.py) still
dequantize their whole weight first and hand out slices of it: their matrices are the decoder layers'
(a quantized head would make a full fp32 copy for prefill-sized logits, ~545 MB for Qwen2.5's).
"""

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

SLAB_BYTES = 32 << 20


@functools.cache
def no_bf16_gemm() -> bool:
    """True where oneDNN has no bf16 GEMM on this CPU (so bf16 F.linear would take the generic loop)."""
    return not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def takes_fp32_gemm(x: torch.Tensor) -> bool:
    """Whether a matmul on `x` should go through widened_linear: a bf16 CPU activation without a bf16 GEMM."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and no_bf16_gemm()


def widened_linear(x: torch.Tensor, out_features: int, weight_rows: Callable[[int, int], torch.Tensor],
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) in fp32, rounded once to x's dtype. `weight_rows(start, end)` returns W's rows
    start..end as an fp32 [end - start, in] matrix (a dense weight widened, or a low-bit one dequantized)."""
    xf = x.float()
    bf = None if bias is None else bias.float()
    step = max(1, SLAB_BYTES // (4 * x.shape[-1]))
    if step >= out_features:
        return F.linear(xf, weight_rows(0, out_features), bf).to(x.dtype)
    out = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype, device=x.device)
    for start in range(0, out_features, step):
        end = min(out_features, start + step)
        out[..., start:end] = F.linear(xf, weight_rows(start, end), None if bf is None else bf[start:end])
    return out
