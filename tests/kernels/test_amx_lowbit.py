"""The AMX low-bit linear kernel against the exact product with the dequantized weight."""

import pytest
import torch

from kvyard.kernels import cpu as cpu_kernels
from kvyard.quant.qlinear import KERNEL_MAX_ROWS, AmxLowBitLinear, Int8Linear, make_linear
from kvyard.quant.qtensor import QuantizedTensor
from kvyard.quant.scheme import parse_weight_scheme

CPU = torch.device("cpu")
SCHEMES = ["int8", "int4-g32", "int4-g64-asym", "int4-g128", "int4-g128-asym"]
needs_amx = pytest.mark.skipif(not cpu_kernels.amx_available(), reason="this CPU has no AMX")


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


@needs_amx
@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize(("out", "inp"), [(32, 128), (96, 576), (64, 1536)])  # 576: a short last group
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 17, 33, KERNEL_MAX_ROWS])  # 1-4: the vector loops (int4: 1)
def test_rounds_the_exact_result_once(name, out, inp, rows):
    """Scales go onto each group's fp32 sum, so the output is the exact x @ dequantized.T rounded once
    to bf16 (within one bf16 step; fp32 summation adds far less)."""
    g = torch.Generator().manual_seed(rows + out + inp)
    qt = QuantizedTensor.quantize(torch.randn(out, inp, generator=g), parse_weight_scheme(name))
    lin = make_linear(qt, torch.bfloat16, CPU)
    assert isinstance(lin, AmxLowBitLinear)
    x = torch.randn(rows, inp, generator=g).bfloat16()
    exact = x.double() @ qt.dequantize().double().T
    got = lin(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    err = (got.double() - exact).abs()
    assert (err <= _bf16_ulp(exact) + 1e-4 * exact.abs().max()).all(), err.max()


@needs_amx
@pytest.mark.parametrize("name", SCHEMES)
def test_blocked_layout_dequantizes_back(name):
    qt = QuantizedTensor.quantize(torch.randn(64, 256), parse_weight_scheme(name))
    lin = AmxLowBitLinear(qt)
    assert torch.allclose(lin.dequantize(torch.float32), qt.dequantize(), atol=1e-6)
    # many rows take the dequantized weight through the dense GEMM
    x = torch.randn(KERNEL_MAX_ROWS + 1, 256).bfloat16()
    assert torch.allclose(lin(x).float(), (x.float() @ qt.dequantize().bfloat16().float().T), atol=0.05, rtol=0.02)


@needs_amx
def test_sizes_and_fallbacks():
    w = torch.randn(512, 1024)
    int8 = make_linear(QuantizedTensor.quantize(w, parse_weight_scheme("int8")), torch.bfloat16, CPU)
    int4 = make_linear(QuantizedTensor.quantize(w, parse_weight_scheme("int4-g128")), torch.bfloat16, CPU)
    assert isinstance(int8, AmxLowBitLinear) and isinstance(int4, AmxLowBitLinear)
    assert int8.nbytes < 0.52 * w.bfloat16().nbytes
    assert int4.nbytes < 0.27 * w.bfloat16().nbytes
    # shapes the blocks do not fit, and fp32 models, keep PyTorch's kernels
    assert isinstance(make_linear(QuantizedTensor.quantize(torch.randn(40, 64), parse_weight_scheme("int8")),
                                  torch.bfloat16, CPU), Int8Linear)
    assert isinstance(make_linear(QuantizedTensor.quantize(w, parse_weight_scheme("int8")), torch.float32, CPU),
                      Int8Linear)


@needs_amx
def test_bad_inputs_raise():
    lin = AmxLowBitLinear(QuantizedTensor.quantize(torch.randn(32, 64), parse_weight_scheme("int4-g32")))
    op = torch.ops.kvyard.amx_linear_lowbit
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="columns"):
        op(torch.randn(2, 32).bfloat16(), lin.q, lin.scale, lin.zero, 4, 32)
    with pytest.raises(RuntimeError, match="bits"):
        op(x, lin.q, lin.scale, lin.zero, 3, 32)
    with pytest.raises(RuntimeError, match="group_size"):
        op(x, lin.q, lin.scale, lin.zero, 4, 48)
    with pytest.raises(RuntimeError, match="scale"):
        op(x, lin.q, lin.scale, lin.zero, 4, 64)  # one group of 64 where the scales have two
    with pytest.raises(RuntimeError, match="scale"):
        op(x, lin.q, lin.scale[:, :16].contiguous(), lin.zero, 4, 32)
