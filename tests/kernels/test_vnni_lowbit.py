"""The low-bit kernels over VNNI blocks (csrc/amx_lowbit.cpp on AMX CPUs, csrc/vnni_lowbit.cpp on other AVX-512
ones) against the exact product with the dequantized weight."""

import pytest
import torch

from kvyard.kernels import cpu as cpu_kernels
from kvyard.quant.qlinear import (
    KERNEL_MAX_ROWS,
    PlainLowBitLinear,
    VnniLowBitLinear,
    make_linear,
)
from kvyard.quant.qtensor import QuantizedTensor
from tests.quant.schemes import scheme

CPU = torch.device("cpu")
SCHEMES = ["int8", "int8-g32", "int8-g32-min", "int4-g32", "int4-g64-asym", "int4-g128", "int4-g128-asym"]
AMX = cpu_kernels.amx_available()
needs_vnni = pytest.mark.skipif(not (AMX or cpu_kernels.vnni_lowbit_available()),
                                reason="this CPU has neither AMX nor AVX-512 VNNI and BF16")


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


def _one_row_in_int16(name: str) -> bool:
    """Whether one row meets the codes as int16 (the AVX-512 kernel's int16 loop): int4 rows on AMX CPUs only
    (amx_linear_lowbit hands them to it; int8 rows keep its exact fp32 vector loop). Without AMX one row takes
    the AVX-512 kernel's bf16 tiles, as several do."""
    return AMX and name.startswith("int4")


def _within_kernel_rounding(got: torch.Tensor, exact: torch.Tensor, ulps: int = 1) -> bool:
    """The exact product rounded once to bf16 (fp32 sums add far less), at every row count: prefill chunks take
    the kernels too, never a weight dequantized to bf16."""
    return bool(((got.double() - exact).abs() <= ulps * _bf16_ulp(exact) + 1e-4 * exact.abs().max()).all())


@needs_vnni
@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize(("out", "inp"), [(32, 128), (96, 576), (64, 1536)])  # 576: a short last group
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 16, 17, 33, KERNEL_MAX_ROWS, 300])  # AMX 1-4: its vector loops
def test_rounds_the_exact_result_once(name, out, inp, rows):
    """Scales go onto each group's fp32 sum, so the output is the exact x @ dequantized.T rounded once
    to bf16 (within one bf16 step; fp32 summation adds far less). (One int4 row on AMX CPUs rounds x to int16
    first: the next test.)"""
    if rows == 1 and _one_row_in_int16(name):
        pytest.skip("one row takes the int16 path here")
    g = torch.Generator().manual_seed(rows + out + inp)
    qt = QuantizedTensor.quantize(torch.randn(out, inp, generator=g), scheme(name))
    lin = make_linear(qt, torch.bfloat16, CPU)
    assert isinstance(lin, VnniLowBitLinear)
    x = torch.randn(rows, inp, generator=g).bfloat16()
    exact = x.double() @ qt.dequantize().double().T
    got = lin(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    assert _within_kernel_rounding(got, exact)


@pytest.mark.skipif(not AMX, reason="the AVX-512 kernel's int16 loop, which only AMX CPUs' int4 rows take")
@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("inp", [128, 576, 1536])
def test_one_row_is_within_the_int16_rounding_of_x(name, inp):
    """One bf16 row: x rounded to int16 per run of up to 128 values inside a weight group. Each output may move by
    at most sum_j |w_ij| * max|x in j's run| / 65534 from the exact product, plus the bf16 rounding of the output
    (and 2^-24 of it for the int32 sums' conversion). An outlier channel only coarsens its own run."""
    if not _one_row_in_int16(name):
        pytest.skip("one int8 row on AMX CPUs takes the exact vector loop")  # int4: amx_linear_lowbit's int16 loop
    torch.manual_seed(inp)
    qt = QuantizedTensor.quantize(torch.randn(96, inp), scheme(name))
    lin = VnniLowBitLinear(qt)
    x = torch.randn(1, inp)
    x[0, 5], x[0, inp - 7] = 300.0, -40.0
    x = x.bfloat16()
    w = qt.dequantize().double()
    ref = (x.double() @ w.T)[0]
    run = next(r for r in (128, 64, 32) if qt.group_size % r == 0)
    padded = torch.nn.functional.pad(x.double().abs(), (0, -inp % run)).view(-1, run).amax(-1)
    run_max = padded.repeat_interleave(run)[:inp]
    bound = (w.abs() @ run_max) / 65534 + ref.abs() * (2.0**-8 + 2.0**-23) + 1e-6
    err = (lin(x)[0].double() - ref).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"
    assert bound.max() < 0.02 * ref.abs().max()  # a tight bound: int8 rounding of x would break it


@needs_vnni
@pytest.mark.parametrize("name", SCHEMES)
def test_blocked_layout_dequantizes_back(name):
    qt = QuantizedTensor.quantize(torch.randn(64, 256), scheme(name))
    lin = VnniLowBitLinear(qt)
    assert torch.allclose(lin.dequantize(torch.float32), qt.dequantize(), atol=1e-6)
    # many rows (a prefill chunk) go through the kernel too, so the result is the exact product rounded once
    x = torch.randn(KERNEL_MAX_ROWS + 1, 256).bfloat16()
    assert _within_kernel_rounding(lin(x), x.double() @ qt.dequantize().double().T)


@needs_vnni
def test_sizes_and_fallbacks():
    w = torch.randn(512, 1024)
    int8 = make_linear(QuantizedTensor.quantize(w, scheme("int8")), torch.bfloat16, CPU)
    int4 = make_linear(QuantizedTensor.quantize(w, scheme("int4-g128")), torch.bfloat16, CPU)
    assert isinstance(int8, VnniLowBitLinear) and isinstance(int4, VnniLowBitLinear)
    assert int8.nbytes < 0.52 * w.bfloat16().nbytes
    assert int4.nbytes < 0.27 * w.bfloat16().nbytes
    # shapes the blocks do not fit, and fp32 models, take the portable kernel
    assert isinstance(make_linear(QuantizedTensor.quantize(torch.randn(40, 64), scheme("int8")),
                                  torch.bfloat16, CPU), PlainLowBitLinear)
    assert isinstance(make_linear(QuantizedTensor.quantize(w, scheme("int8")), torch.float32, CPU),
                      PlainLowBitLinear)


@needs_vnni
def test_bad_inputs_raise():
    lin = VnniLowBitLinear(QuantizedTensor.quantize(torch.randn(32, 64), scheme("int4-g32")))
    op = torch.ops.kvyard.amx_linear_lowbit if AMX else torch.ops.kvyard.vnni_lowbit_linear
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


@needs_vnni
@pytest.mark.parametrize("name", [s for s in SCHEMES if not s.endswith("-min")])  # -min grids need not hold 0
# AMX: vector loops (1-4), tiles widening k chunk by chunk (7, 20, 70) or whole column blocks (150)
@pytest.mark.parametrize("rows", [1, 3, 7, 20, 70, 150])
# an odd count: the last pair padded; 64 columns: more pairs than one row's runs of codes, several a run, and on the
# AMX tiles two whole k blocks of pairs; 41 columns: one whole k block and a partial one
@pytest.mark.parametrize("cols", [[0, 17, 300, 575], [3, 40, 41], list(range(1, 576, 9)), list(range(2, 576, 14))])
def test_outlier_columns_are_added_in_full_precision(name, rows, cols):
    """Columns kept beside the codes (LLM.int8-style) come out as exact fp32 products, the rest as before."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 576, generator=g)
    qt = QuantizedTensor.quantize(w, scheme(name), torch.tensor(cols))
    lin = make_linear(qt, torch.bfloat16, CPU)
    # both kernels (AMX and AVX-512) add them themselves, from bf16 (the bf16 model's own values)
    assert isinstance(lin, VnniLowBitLinear) and lin.nbytes > VnniLowBitLinear(
        QuantizedTensor(qt.scheme, qt.q, qt.scale, qt.zero_point)).nbytes
    x = torch.randn(rows, 576, generator=g).bfloat16()
    served = qt.dequantize()  # the kept columns as the layer holds them
    served[:, qt.outlier_cols] = qt.outliers.bfloat16().float()
    exact = x.double() @ served.double().T
    assert _within_kernel_rounding(lin(x), exact, ulps=2)
    assert torch.allclose(lin.dequantize(torch.float32), served, atol=1e-6)


@needs_vnni
@pytest.mark.parametrize("name", SCHEMES)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(name):
    """On the tiles each row's sums run in the same order whatever else is in the call, so a prompt gives the same
    layer outputs whole (300 rows; on AMX column blocks widened once, rows 256 at a time) or in prefill chunks of
    any size the tiles take. On AMX int8 below 5 rows, and one int4 row, take the vector loops instead; the AVX-512
    kernel's tiles take every row count, one row too (the batch-invariant path relies on it)."""
    g = torch.Generator().manual_seed(7)
    kept = None if name.endswith("-min") else torch.tensor([3, 40, 41, 300])  # a -min grid need not hold 0
    qt = QuantizedTensor.quantize(torch.randn(96, 576, generator=g), scheme(name), kept)
    lin = make_linear(qt, torch.bfloat16, CPU)
    x = torch.randn(300, 576, generator=g).bfloat16()
    whole = lin(x)
    for a, b in [(0, 5), (5, 21), (21, 64), (64, 200), (200, 300), (17, 290)]:
        assert torch.equal(lin(x[a:b]), whole[a:b]), (a, b)
    if not AMX:
        for i in (0, 6, 7, 299):  # a tile's first and last row, the next tile's first, the call's last
            assert torch.equal(lin(x[i : i + 1])[0], whole[i]), i
