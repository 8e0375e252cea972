"""kvyard's few-row bf16 matmul (csrc/linear_bf16.cpp) against an exact product."""

import pytest
import torch

from kvyard.kernels import cpu as cpu_kernels
from kvyard.models.linear import FEW_ROWS, linear


@pytest.fixture(autouse=True)
def kernels():
    assert cpu_kernels.available(), "the CPU kernels did not build"


# (960, 576) and (576, 1536) SmolLM2's fused q|k|v and down; (7, 96) rows not in whole blocks of four;
# (12, 30) columns not in whole vectors of eight (the scalar path).
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (7, 96), (12, 30)])
@pytest.mark.parametrize("rows", [1, 3, 32])  # the one-row stream, and the widened blocks
def test_is_the_fp32_product_rounded_once(shape, rows):
    torch.manual_seed(0)
    w = torch.randn(shape).bfloat16()
    x = torch.randn(rows, shape[1]).bfloat16()
    y = torch.ops.kvyard.linear_bf16(x, w)
    assert y.shape == (rows, shape[0]) and y.dtype == torch.bfloat16
    ref = x.double() @ w.double().T
    # fp32 sums in another order than float64: a few fp32 ulps of the sum of |terms|, then one bf16 rounding.
    slack = (x.double().abs() @ w.double().abs().T) * 1e-6
    assert ((y.double() - ref).abs() <= ref.abs() * 2**-8 + slack).all()


@pytest.mark.parametrize("shape", [(960, 576), (7, 96)])
def test_a_rows_result_does_not_depend_on_its_neighbours(shape):
    """The widened loop takes x rows three, two or one at a time; each sum keeps one order whatever the grouping,
    so a row's output is bit-identical in calls of 2 to 8 rows (chunked prefill and batching rely on it)."""
    torch.manual_seed(0)
    w = torch.randn(shape).bfloat16()
    x = torch.randn(8, shape[1]).bfloat16()
    full = torch.ops.kvyard.linear_bf16(x, w)
    for rows in range(2, 8):
        assert torch.equal(torch.ops.kvyard.linear_bf16(x[:rows], w), full[:rows]), rows
    assert torch.equal(torch.ops.kvyard.linear_bf16(x[[5, 1]], w), full[[5, 1]])


@pytest.mark.skipif(torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN's bf16 GEMM serves here")
@pytest.mark.parametrize("rows", [1, FEW_ROWS])
def test_linear_takes_it_for_a_decode_step_and_adds_the_bias(rows):
    torch.manual_seed(0)
    w, b = torch.randn(64, 32).bfloat16(), torch.randn(64).bfloat16()
    x = torch.randn(rows, 32).bfloat16()
    assert torch.equal(linear(x, w, b), torch.ops.kvyard.linear_bf16(x, w) + b)


def test_bad_inputs_raise():
    w = torch.randn(8, 16).bfloat16()
    with pytest.raises(RuntimeError, match="bf16 \\[rows, in\\]"):
        torch.ops.kvyard.linear_bf16(torch.randn(2, 16), w)
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.kvyard.linear_bf16(torch.randn(1, 8).bfloat16(), w)
    with pytest.raises(RuntimeError, match="bf16 \\[out, in\\]"):
        torch.ops.kvyard.linear_bf16(torch.randn(1, 16).bfloat16(), w.float())
