"""The AVX512-BF16 linear kernel (csrc/dpbf16_linear.cpp) against an fp64 matmul of the same bf16 values, and the
weight form chosen at load on CPUs that have it but no AMX."""

import pytest
import torch

from kvyard.config import EngineConfig
from kvyard.engine.llm_engine import LLMEngine
from kvyard.kernels import cpu as cpu_kernels
from kvyard.models.linear import VnniWeight, linear, pack_weight, row_invariant

needs_dpbf16 = pytest.mark.skipif(not cpu_kernels.dpbf16_available(), reason="this CPU has no AVX512-BF16")
without_amx = pytest.mark.skipif(cpu_kernels.amx_available(), reason="AMX CPUs run the AMX kernel instead")


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values around |x| (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


@needs_dpbf16
@pytest.mark.parametrize("rows", [1, 2, 5, 11, 12, 13, 24, 37, 300])
@pytest.mark.parametrize(("out", "inp"), [(32, 32), (64, 96), (96, 64), (96, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_rounds_the_exact_product_once(rows, out, inp, bias):
    """Every row-tile size (1 to 12 rows, and several tiles) against fp64: bf16 x bf16 products are exact in
    fp32, so each output is an fp32 sum rounded once, at most one bf16 step from the exact result."""
    g = torch.Generator().manual_seed(rows * 1000 + out + inp)
    w = torch.randn(out, inp, generator=g).bfloat16()
    x = torch.randn(rows, inp, generator=g).bfloat16()
    b = torch.randn(out, generator=g).bfloat16() if bias else None
    got = torch.ops.kvyard.dpbf16_linear(x, VnniWeight.tile(w).blocks, b)
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    err = (got.double() - exact).abs()
    assert (err <= _bf16_ulp(exact) + 1e-6 * exact.abs().max()).all(), err.max()


@needs_dpbf16
@pytest.mark.parametrize("inp", [64, 576, 1536])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(inp):
    """Each output is one chain over k's pairs in every tile (1-12 rows): a row alone, in a tile's remainder or
    in a full tile comes out the same to the bit, in bf16 and in the logits' fp32. The batch-invariant path runs
    on this kernel where it is the CPU's VNNI kernel (row_invariant)."""
    g = torch.Generator().manual_seed(inp)
    blocks = VnniWeight.tile(torch.randn(96, inp, generator=g).bfloat16()).blocks
    x = torch.randn(40, inp, generator=g).bfloat16()
    full = torch.ops.kvyard.dpbf16_linear(x, blocks, None)
    full_f32 = torch.ops.kvyard.dpbf16_linear_f32(x, blocks)
    for start, rows in [(0, 1), (7, 1), (39, 1), (0, 2), (3, 11), (5, 13), (1, 25), (12, 28)]:
        part = x[start : start + rows]
        assert torch.equal(torch.ops.kvyard.dpbf16_linear(part, blocks, None), full[start : start + rows])
        assert torch.equal(torch.ops.kvyard.dpbf16_linear_f32(part, blocks), full_f32[start : start + rows])


@needs_dpbf16
@without_amx
def test_the_batch_invariant_path_keeps_the_blocks():
    w = torch.randn(96, 64).bfloat16()
    assert isinstance(row_invariant(w), VnniWeight)


@needs_dpbf16
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 32, 300])
def test_logits_come_back_as_the_bf16_product_widened_to_fp32(rows):
    """dpbf16_linear_f32 (a model head's logits for sampling) equals dpbf16_linear(...).float() bit for bit."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(4096, 96, generator=g).bfloat16()
    x = torch.randn(rows, 96, generator=g).bfloat16()
    weight = VnniWeight.tile(w)
    got = torch.ops.kvyard.dpbf16_linear_f32(x, weight.blocks)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.ops.kvyard.dpbf16_linear(x, weight.blocks, None).float())
    # the head's contract: its own product widened (the AVX512-BF16 kernel's above; on AMX CPUs the AMX kernel's)
    assert torch.equal(weight.logits(x), weight(x).float())
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.kvyard.dpbf16_linear_f32(torch.randn(2, 64).bfloat16(), weight.blocks)


@needs_dpbf16
def test_reads_a_strided_x():
    w = torch.randn(64, 96).bfloat16()
    x = torch.randn(96, 5).bfloat16().T  # not contiguous
    got = torch.ops.kvyard.dpbf16_linear(x, VnniWeight.tile(w).blocks, None)
    assert torch.equal(got, torch.ops.kvyard.dpbf16_linear(x.contiguous(), VnniWeight.tile(w).blocks, None))


@needs_dpbf16
def test_bad_inputs_raise():
    blocks = VnniWeight.tile(torch.randn(32, 64).bfloat16()).blocks
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.kvyard.dpbf16_linear(torch.randn(2, 32).bfloat16(), blocks, None)
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.kvyard.dpbf16_linear(torch.randn(2, 64), blocks, None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.kvyard.dpbf16_linear(torch.randn(2, 64).bfloat16(), blocks, torch.randn(31).bfloat16())
    with pytest.raises(RuntimeError, match="VNNI"):
        torch.ops.kvyard.dpbf16_linear(torch.randn(2, 64).bfloat16(), torch.randn(32, 64).bfloat16(), None)


@needs_dpbf16
@without_amx
def test_weights_take_the_blocks_once(monkeypatch):
    """One copy per weight (the register kernel ties oneDNN at prefill sizes, so none of oneDNN's is kept);
    shapes the blocks cannot hold, and KVYARD_DPBF16=0, keep oneDNN's packed layout."""
    w = torch.randn(96, 64).bfloat16()
    packed = pack_weight(w, max_rows=2048, gate_up=True)
    assert isinstance(packed, VnniWeight) and packed.onednn is None and packed.onednn_halves is None
    assert packed.nbytes == w.nbytes
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(linear(x, packed), torch.ops.kvyard.dpbf16_linear(x, packed.blocks, None))
    assert pack_weight(torch.randn(96, 80).bfloat16()).is_mkldnn  # 80 is not a multiple of 32
    monkeypatch.setenv("KVYARD_DPBF16", "0")
    assert pack_weight(w).is_mkldnn


@needs_dpbf16
@without_amx
def test_engine_runs_on_the_blocks(tiny_checkpoint):
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), dtype="bfloat16"))
    layers = engine.runner.model.layers
    assert all(isinstance(w, VnniWeight) for layer in layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert engine.compute_logits(list(range(3, 40))).isfinite().all()
