"""The low-bit kernels agree with a matmul on the dequantized weight."""

import pytest
import torch

from kvyard.kernels import cpu as cpu_kernels
from kvyard.quant.qlinear import (
    KERNEL_MAX_ROWS,
    Int4Linear,
    Int8Linear,
    OutlierColumns,
    PlainLowBitLinear,
    make_linear,
)
from kvyard.quant.qtensor import QuantizedTensor
from tests.quant.schemes import scheme

CPU = torch.device("cpu")


@pytest.mark.parametrize("name", ["int8", "int8-g32", "int8-g32-min", "int4-g32", "int4-g64-asym", "int4-g128", "int4-g32-min"])
@pytest.mark.parametrize("shape", [(96, 200), (128, 576), (400, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, KERNEL_MAX_ROWS + 9])  # kernel path, and dequantize-then-GEMM
def test_matches_dequantized_reference(name, shape, dtype, rows):
    torch.manual_seed(0)
    qt = QuantizedTensor.quantize(torch.randn(shape), scheme(name))
    lin = make_linear(qt, dtype, CPU)
    x = torch.randn(rows, shape[1]).to(dtype)
    ref = x.double() @ qt.dequantize().to(dtype).double().T
    y = lin(x)
    assert y.shape == (rows, shape[0]) and y.dtype == dtype
    rel = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    assert rel < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("name", ["int8", "int8-g32", "int8-g32-min", "int4-g32", "int4-g128-asym"])
def test_dequantize_unpacks_the_kernel_layout(name):
    qt = QuantizedTensor.quantize(torch.randn(200, 160), scheme(name))
    lin = make_linear(qt, torch.float32, CPU)
    assert torch.allclose(lin.dequantize(torch.float32), qt.dequantize(), atol=1e-6)


@pytest.mark.parametrize("name", ["int8", "int8-g32", "int8-g32-min"])
@pytest.mark.parametrize("rows", [1, KERNEL_MAX_ROWS + 9])
def test_pytorch_int8_form_matches_dequantized_reference(name, rows):
    """The last-resort int8 form (CPUs where kvyard's kernels do not build): per channel on PyTorch's kernel,
    grouped or zero-pointed (GGUF's Q8_0, Q5_0, Q5_1) dequantized with its fp32 scales."""
    torch.manual_seed(0)
    qt = QuantizedTensor.quantize(torch.randn(96, 200), scheme(name))
    lin = Int8Linear(qt, torch.float32, CPU)
    assert torch.allclose(lin.dequantize(torch.float32), qt.dequantize(), atol=1e-6)
    x = torch.randn(rows, 200)
    ref = x.double() @ qt.dequantize().double().T
    assert ((lin(x).double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_low_bit_weights_are_smaller():
    w = torch.randn(512, 1024)
    int8 = Int8Linear(QuantizedTensor.quantize(w, scheme("int8")), torch.bfloat16, CPU)
    int4 = Int4Linear(QuantizedTensor.quantize(w, scheme("int4-g128")), torch.bfloat16, CPU)
    dense = w.bfloat16().nbytes
    assert int8.nbytes < 0.52 * dense
    assert int4.nbytes < 0.27 * dense


@pytest.mark.skipif(not cpu_kernels.available(), reason="kvyard's CPU kernels did not build here")
@pytest.mark.parametrize("name", ["int8", "int8-g32", "int8-g32-min", "int4-g32", "int4-g64-asym", "int4-g128", "int4-g64-min"])
@pytest.mark.parametrize("shape", [(98, 200), (128, 576), (7, 96)])  # rows not in whole blocks of four
@pytest.mark.parametrize("rows", [1, 3, 4, 17, KERNEL_MAX_ROWS + 9])
def test_portable_kernel_matches_dequantized_reference(name, shape, rows):
    """kvyard's portable low-bit kernel (the one CPUs without AMX take), whatever this machine prefers."""
    torch.manual_seed(0)
    qt = QuantizedTensor.quantize(torch.randn(shape), scheme(name))
    lin = PlainLowBitLinear(qt)
    assert torch.allclose(lin.dequantize(torch.float32), qt.dequantize(), atol=1e-6)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        x = torch.randn(rows, shape[1]).to(dtype)
        ref = x.double() @ qt.dequantize().double().T
        y = lin(x)
        assert y.shape == (rows, shape[0]) and y.dtype == dtype
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < tol


@pytest.mark.skipif(not cpu_kernels.available(), reason="kvyard's CPU kernels did not build here")
@pytest.mark.parametrize("name", ["int8", "int4-g32", "int4-g64-asym", "int4-g128"])
def test_one_bf16_row_is_within_the_int16_rounding_of_x(name):
    """A batch-1 bf16 call rounds x to int16 per run of 32 (lowbit_linear.cpp): each output may move by at most
    sum_j |w_ij| * max|x in j's run| / 65534 from the exact product, plus the bf16 rounding of the output.
    An outlier channel (as LLM activations have) only coarsens its own run."""
    torch.manual_seed(0)
    n, k = 128, 576
    qt = QuantizedTensor.quantize(torch.randn(n, k), scheme(name))
    lin = PlainLowBitLinear(qt)
    x = torch.randn(1, k)
    x[0, 5], x[0, 300] = 300.0, -40.0
    x = x.bfloat16()
    w = qt.dequantize().double()
    ref = (x.double() @ w.T)[0]
    run_max = x.double().abs().view(-1, 32).amax(-1).repeat_interleave(32)
    bound = (w.abs() @ run_max) / 65534 + ref.abs() * 2.0**-8 + 1e-6
    err = (lin(x)[0].double() - ref).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"
    assert bound.max() < 0.02 * ref.abs().max()  # the bound is tight: int8 rounding of x would break it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["plain", "torch"])
def test_outlier_columns_on_kernels_that_lack_them(dtype, form):
    """Forms whose kernel knows no outlier columns get them added beside it (OutlierColumns)."""
    torch.manual_seed(1)
    qt = QuantizedTensor.quantize(torch.randn(40, 96), scheme("int4-g32-asym"), torch.tensor([5, 60]))
    inner = PlainLowBitLinear(qt) if form == "plain" else Int4Linear(qt, dtype, torch.device("cpu"))
    lin = OutlierColumns(inner, qt.outlier_cols, qt.outliers)
    for rows in (1, 80):
        x = torch.randn(rows, 96).to(dtype)
        ref = x.double() @ qt.dequantize().double().T
        assert ((lin(x).double() - ref).abs().max() / ref.abs().max()) < (1e-5 if dtype == torch.float32 else 1e-2)
    # (PyTorch's int4 kernel keeps its scales in the compute dtype, so bf16 ones are rounded)
    assert torch.allclose(lin.dequantize(torch.float32), qt.dequantize(), atol=1e-5 if dtype == torch.float32 else 2e-2)
    assert lin.nbytes == inner.nbytes + qt.outlier_cols.nbytes + qt.outliers.nbytes
