"""Low-bit weights against int8-rounded activations (csrc/lowbit_int8_act.cpp, --dynamic-quant) against a float64
reference that rounds x the same way, and the layer and config switches around it."""

import pytest
import torch

from kvyard.config import EngineConfig
from kvyard.errors import ConfigError, InvalidRequestError
from kvyard.kernels import cpu as cpu_kernels
from kvyard.llm import LLM
from kvyard.quant.qlinear import PlainLowBitLinear, make_linear
from kvyard.quant.qtensor import QuantizedTensor
from tests.quant.schemes import scheme

CPU = torch.device("cpu")
needs_avx2 = pytest.mark.skipif(not cpu_kernels.int8_act_available(), reason="kvyard's AVX2 kernels are not built here")
SCHEMES = ["int8", "int4-g32", "int4-g32-min", "int4-g64-asym", "int4-g128-asym"]


def _rounded_x(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel rounds it, in the kernel's fp32 steps: each run of 32 values times 127 / its largest
    magnitude, to the nearest integer (ties to even), times largest / 127."""
    runs = x.float().view(x.shape[0], -1, 32)
    amax = runs.abs().amax(-1, keepdim=True)
    inv = torch.full_like(amax, 127.0) / amax  # a true division: torch takes 127 / amax as 127 * (1 / amax)
    codes = torch.round(runs * torch.where(amax > 0, inv, 0))
    return (codes.double() * (amax / 127).double()).view(x.shape)


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


def _layer(name: str, out: int, inp: int, seed: int) -> tuple[QuantizedTensor, PlainLowBitLinear]:
    g = torch.Generator().manual_seed(seed)
    qt = QuantizedTensor.quantize(torch.randn(out, inp, generator=g), scheme(name))
    return qt, PlainLowBitLinear(qt, int8_activations=True)


@needs_avx2
@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize(("out", "inp"), [(32, 128), (100, 576), (64, 1536)])  # 100: a partial last block of rows
@pytest.mark.parametrize("rows", [2, 3, 8, 33, 97, 512])  # 97: past one tile of 96 rows
def test_matches_the_rounded_reference(name, out, inp, rows):
    """Integer sums are exact, so the output is x_rounded @ dequantized.T rounded once to bf16, up to the fp32
    sums over runs (1e-4 of the largest output)."""
    qt, lin = _layer(name, out, inp, rows + out)
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows)).bfloat16()
    expected = _rounded_x(lin._pad_x(x))[:, :inp] @ qt.dequantize().double().T
    got = lin(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    err = (got.double() - expected).abs()
    assert bool((err <= _bf16_ulp(expected) + 1e-4 * expected.abs().max()).all()), float(err.max())


@needs_avx2
def test_a_rows_result_depends_on_that_row_alone():
    """Each row is rounded and summed on its own, in one order: alone in a pair or among 300, the same bits."""
    _, lin = _layer("int4-g32-min", 96, 576, 1)
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(2)).bfloat16()
    whole = lin(x)
    assert torch.equal(lin(x[:2]), whole[:2])
    assert torch.equal(lin(x[150:183]), whole[150:183])


@needs_avx2
def test_one_row_and_fp32_keep_the_exact_kernel():
    """A single row (a batch-1 decode) and fp32 inputs never round x to int8."""
    qt, lin = _layer("int4-g32", 64, 576, 3)
    plain = PlainLowBitLinear(qt)
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(4))
    assert torch.equal(lin(x[:1].bfloat16()), plain(x[:1].bfloat16()))
    assert torch.equal(lin(x), plain(x))
    assert not torch.equal(lin(x.bfloat16()), plain(x.bfloat16()))  # two bf16 rows take the int8 path


@needs_avx2
def test_make_linear_takes_the_portable_layout():
    """--dynamic-quant means the same kernel on every CPU kind, so VNNI blocks are never chosen for it."""
    qt = QuantizedTensor.quantize(torch.randn(64, 128), scheme("int4-g32"))
    lin = make_linear(qt, torch.bfloat16, CPU, int8_activations=True)
    assert isinstance(lin, PlainLowBitLinear) and lin.int8_activations


@pytest.mark.parametrize(("fields", "named"), [
    ({"quantization": "gguf", "dtype": "float32"}, "dtype float32"),
    ({"quantization": "gguf", "batch_invariant": True}, "batch_invariant"),
])
def test_config_refuses_what_it_does_not_cover(fields, named):
    with pytest.raises(InvalidRequestError, match=named):
        EngineConfig(model="m", dynamic_quant=True, **fields)


def test_a_model_without_low_bit_weights_is_refused(tiny_checkpoint):
    """The switch acts on low-bit weights only: on a dense model it would silently do nothing."""
    with pytest.raises(ConfigError, match="has none"):
        LLM(config=EngineConfig(model=str(tiny_checkpoint("llama")), dynamic_quant=True, kv_cache_memory="16MiB"))
