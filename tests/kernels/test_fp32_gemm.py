"""Prefill-sized bf16 matmuls through the fp32 GEMM: the same values as the exact product, rounded once."""

import pytest
import torch

from kvyard.kernels import fp32_gemm
from kvyard.models.linear import FEW_ROWS, linear


def exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


def within_one_rounding(y: torch.Tensor, ref: torch.Tensor) -> bool:
    """Each bf16 output within one bf16 step (2^-8 relative) of the exact value, plus fp32 summation noise."""
    return bool(((y.double() - ref).abs() <= ref.abs() * 2.0**-8 + 1e-4 * ref.abs().max()).all())


@pytest.mark.parametrize("bias", [False, True])
def test_slabs_give_the_same_product_as_one_call(monkeypatch, bias):
    torch.manual_seed(0)
    x, w = torch.randn(70, 96).bfloat16(), torch.randn(250, 96).bfloat16()
    b = torch.randn(250).bfloat16() if bias else None
    whole = fp32_gemm.widened_linear(x, 250, lambda s, e: w[s:e].float(), b)
    monkeypatch.setattr(fp32_gemm, "SLAB_BYTES", 4 * 96 * 64)  # slabs of 64 rows, the last one short
    rows_asked = []

    def rows(s: int, e: int) -> torch.Tensor:
        rows_asked.append((s, e))
        return w[s:e].float()

    slabbed = fp32_gemm.widened_linear(x, 250, rows, b)
    assert rows_asked == [(0, 64), (64, 128), (128, 192), (192, 250)]
    assert slabbed.dtype == torch.bfloat16 and slabbed.shape == (70, 250)
    assert within_one_rounding(slabbed, exact(x, w, b)) and within_one_rounding(whole, exact(x, w, b))
    assert (slabbed.float() - whole.float()).abs().max() <= whole.float().abs().max() * 2.0**-7


@pytest.mark.parametrize("rows", [FEW_ROWS + 1, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_prefill_sized_bf16_linear_is_the_exact_product_rounded_once(rows, bias):
    """Whichever GEMM this machine takes for a prefill chunk (fp32 on widened values where oneDNN has no bf16
    GEMM), the result is the exact product within one bf16 rounding."""
    torch.manual_seed(1)
    x, w = torch.randn(rows, 192).bfloat16(), torch.randn(320, 192).bfloat16()
    b = torch.randn(320).bfloat16() if bias else None
    y = linear(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 320)
    assert within_one_rounding(y, exact(x, w, b))


def test_only_bf16_cpu_activations_take_the_fp32_gemm():
    assert not fp32_gemm.takes_fp32_gemm(torch.zeros(2, 2))
    assert fp32_gemm.takes_fp32_gemm(torch.zeros(2, 2, dtype=torch.bfloat16)) == fp32_gemm.no_bf16_gemm()
