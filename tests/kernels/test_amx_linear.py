"""The AMX linear kernel against an fp32 matmul of the same bf16 values, and the weight form chosen at load."""

import pytest
import torch

from kvyard.config import EngineConfig
from kvyard.engine.llm_engine import LLMEngine
from kvyard.kernels import cpu as cpu_kernels
from kvyard.models.linear import AMX_MAX_ROWS, VnniWeight, gated_mlp_input, linear, pack_weight

needs_amx = pytest.mark.skipif(not cpu_kernels.amx_available(), reason="this CPU has no AMX")


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values around |x| (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


@needs_amx
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 32, 45, 300, 2100])
@pytest.mark.parametrize(("out", "inp"), [(32, 32), (64, 96), (96, 64), (96, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_rounds_the_exact_product_once(rows, out, inp, bias):
    """bf16 x bf16 products are exact in fp32, so each output is the fp32 sum rounded once to bf16: at most
    one bf16 step from the fp64 result (the fp32 accumulation order adds far less)."""
    g = torch.Generator().manual_seed(rows * 1000 + out + inp)
    w = torch.randn(out, inp, generator=g).bfloat16()
    x = torch.randn(rows, inp, generator=g).bfloat16()
    b = torch.randn(out, generator=g).bfloat16() if bias else None
    packed = pack_weight(w)
    assert isinstance(packed, VnniWeight) and packed.shape == (out, inp)
    assert packed.nbytes == 2 * w.nbytes  # the blocks and oneDNN's copy for prefill-sized calls
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    for weight in (packed, VnniWeight.tile(w)):  # the second runs the AMX loop at every row count
        got = linear(x, weight, b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
        err = (got.double() - exact).abs()
        assert (err <= _bf16_ulp(exact) + 1e-6 * exact.abs().max()).all(), err.max()


@needs_amx
def test_untileable_shapes_and_opt_out_keep_onednn(monkeypatch):
    assert pack_weight(torch.randn(96, 80).bfloat16()).is_mkldnn  # 80 is not a multiple of 32
    assert pack_weight(torch.randn(48, 64).bfloat16()).is_mkldnn  # 48 is not a multiple of 32
    monkeypatch.setenv("KVYARD_AMX", "0")
    monkeypatch.setenv("KVYARD_DPBF16", "0")  # else AMX CPUs (which have AVX512-BF16) take the register kernel
    assert pack_weight(torch.randn(64, 64).bfloat16()).is_mkldnn


@needs_amx
def test_blocks_hold_the_vnni_pairs():
    w = torch.randn(64, 96).bfloat16()
    tiles = VnniWeight.tile(w).blocks
    for nb, p, n, j in [(0, 0, 0, 0), (1, 37, 5, 1), (1, 47, 31, 1)]:
        assert tiles[nb, p, n, j] == w[nb * 32 + n, 2 * p + j]


@needs_amx
def test_bad_inputs_raise():
    packed = VnniWeight.tile(torch.randn(32, 64).bfloat16())
    with pytest.raises(RuntimeError, match="columns"):
        packed(torch.randn(2, 32).bfloat16())
    with pytest.raises(RuntimeError, match="bf16"):
        packed(torch.randn(2, 64))
    with pytest.raises(RuntimeError, match="bias"):
        packed(torch.randn(2, 64).bfloat16(), torch.randn(31).bfloat16())


@needs_amx
@pytest.mark.parametrize(("budget", "copies"), [(512, 1), (2048, 2)])
def test_engine_keeps_onednn_copy_only_for_prefill_sized_steps(tiny_checkpoint, budget, copies):
    """A step never carries more rows than the token budget, so a 512-token engine (servers) holds its
    weights once; the offline 2,048-token one keeps oneDNN's copy for its prefill chunks."""
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), dtype="bfloat16",
                                    max_num_batched_tokens=budget))
    layers = engine.runner.model.layers
    weights = [w for layer in layers for w in (layer.qkv, layer.o, layer.down)]
    assert all(isinstance(w, VnniWeight) and (w.onednn is not None) == (copies == 2) for w in weights)
    # gate|up keeps its two halves instead, for the fused MLP of prefill-sized steps
    assert all(layer.gate_up.onednn is None and (layer.gate_up.onednn_halves is not None) == (copies == 2)
               for layer in layers)
    prompt = list(range(3, 40))
    assert engine.compute_logits(prompt).isfinite().all()


@needs_amx
@pytest.mark.parametrize("rows", [AMX_MAX_ROWS, AMX_MAX_ROWS + 1, 1500])
def test_gated_mlp_input_fuses_only_prefill_sized_calls(rows):
    """silu(gate) * up from oneDNN's post-ops: within two bf16 steps of the fp64 result (it rounds the
    activated gate once, then the product), as close as linear + silu_mul; up to AMX_MAX_ROWS it declines."""
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(128, 96, generator=g) / 8).bfloat16()  # gate (64 rows) | up (64 rows)
    x = torch.randn(rows, 96, generator=g).bfloat16()
    packed = pack_weight(w, gate_up=True)
    assert packed.onednn is None and packed.nbytes == 2 * w.nbytes
    got = gated_mlp_input(x, packed)
    if rows <= AMX_MAX_ROWS:
        assert got is None
        return
    gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
    exact = torch.nn.functional.silu(gate) * up
    err = (got.double() - exact).abs()
    assert got.shape == (rows, 64) and (err <= 2 * _bf16_ulp(exact) + 1e-3 * exact.abs().max()).all(), err.max()
    assert gated_mlp_input(x, pack_weight(w)) is None  # a weight packed without halves
