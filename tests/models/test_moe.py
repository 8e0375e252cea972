"""The grouped MoE path against a naive loop over tokens and their experts, and its routing counters."""

import pytest
import torch
import torch.nn.functional as F

from kvyard.models.decoder import silu_mul
from kvyard.models.moe import MoeWeights, SharedExpert, moe_mlp, stack_experts

HIDDEN, INTER, EXPERTS = 32, 24, 6


def _moe(dtype: torch.dtype, top_k: int, norm: bool, shared: bool) -> tuple[MoeWeights, list]:
    torch.manual_seed(0)
    per_expert = [[torch.randn(INTER, HIDDEN), torch.randn(INTER, HIDDEN), torch.randn(HIDDEN, INTER)]
                  for _ in range(EXPERTS)]
    per_expert = [[t.to(dtype) / 4 for t in e] for e in per_expert]
    gate_up, down = stack_experts(*(list(w) for w in zip(*per_expert, strict=True)))
    extra = None
    if shared:
        extra = SharedExpert(torch.randn(2 * INTER, HIDDEN, dtype=dtype) / 4, torch.randn(HIDDEN, INTER, dtype=dtype) / 4,
                             torch.randn(1, HIDDEN, dtype=dtype))
    return MoeWeights(torch.randn(EXPERTS, HIDDEN, dtype=dtype), gate_up, down, top_k, norm, extra), per_expert


def _naive(x: torch.Tensor, moe: MoeWeights, per_expert: list) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(F.linear(x[t].float(), moe.router.float()), dim=-1)
        w, e = probs.topk(moe.top_k)
        if moe.norm_topk_prob:
            w = w / w.sum()
        for weight, expert in sorted(zip(w.tolist(), e.tolist(), strict=True), key=lambda p: p[1]):
            g, u, d = per_expert[expert]
            h = F.silu(x[t] @ g.T) * (x[t] @ u.T)
            out[t] += (h @ d.T) * torch.tensor(weight, dtype=x.dtype)
        if moe.shared is not None:
            s = moe.shared
            gate, up = (x[t] @ s.gate_up.T).chunk(2)
            out[t] += torch.sigmoid(x[t] @ s.gate.T) * ((F.silu(gate) * up) @ s.down.T)
    return out


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 6e-2)])
@pytest.mark.parametrize("top_k,norm,shared", [(2, True, False), (3, False, True), (1, False, False)])
def test_grouped_experts_equal_a_naive_loop(dtype, atol, top_k, norm, shared):
    moe, per_expert = _moe(dtype, top_k, norm, shared)
    x = torch.randn(37, HIDDEN, dtype=dtype)
    got = moe_mlp(x, moe, silu_mul)
    torch.testing.assert_close(got.float(), _naive(x, moe, per_expert).float(), atol=atol, rtol=atol)


def test_every_routed_token_is_counted_once_per_expert():
    moe, _ = _moe(torch.float32, 2, True, False)
    moe_mlp(torch.randn(10, HIDDEN), moe, silu_mul)
    moe_mlp(torch.randn(5, HIDDEN), moe, silu_mul)
    assert moe.tokens_per_expert.shape == (EXPERTS,) and int(moe.tokens_per_expert.sum()) == 2 * 15


@pytest.mark.parametrize("scheme", ["int8", "int4-g32-asym"])
def test_low_bit_experts_keep_codes_and_stay_close(tiny_checkpoint, scheme):
    from kvyard import LLM
    from kvyard.models.moe import LowBitExperts

    path = str(tiny_checkpoint("qwen3_moe"))
    dense, low = LLM(path, dtype="float32"), LLM(path, dtype="float32", quantization=scheme)
    moes = [layer.moe for layer in low.engine.runner.model.layers if layer.moe is not None]
    assert moes and all(isinstance(m.gate_up, LowBitExperts) and m.gate_up.q.dtype == torch.int8 for m in moes)
    assert moes[0].gate_up.q.shape == (4, 2 * 32, 64)  # experts, gate|up rows, hidden
    prompt = low.tokenizer("The quick brown fox jumps").input_ids
    ours, ref = low.engine.compute_logits(prompt), dense.engine.compute_logits(prompt)
    # Rounding error only (every linear weight is low-bit here, experts or not): the logits move by a fraction of
    # their spread (two unrelated models differ by about 1.4 spreads), and the top choice stays.
    assert (ours - ref).abs().max().item() < (0.05 if scheme == "int8" else 0.5) * ref.std().item()
    assert ours.argmax() == ref.argmax()


@pytest.mark.parametrize("scheme", ["int8", "int4-g32-asym", "int4-g64"])
def test_stacked_codes_dequantize_as_each_expert_does(scheme):
    from kvyard.models.moe import LowBitExperts
    from kvyard.quant.qtensor import QuantizedTensor
    from kvyard.quant.scheme import parse_weight_scheme

    torch.manual_seed(1)
    parts = [QuantizedTensor.quantize(torch.randn(24, 80), parse_weight_scheme(scheme)) for _ in range(3)]
    stacked = LowBitExperts.stack(parts, torch.float32).dequantize()  # [experts, in, out]
    for e, part in enumerate(parts):
        torch.testing.assert_close(stacked[e], part.dequantize().T, atol=0, rtol=0)
