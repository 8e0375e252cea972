"""The decode step's fast paths compute exactly what the plain formulas do."""

import pytest
import torch
import torch.nn.functional as F

import kvyard.models.decoder as decoder
from kvyard import LLM
from kvyard.kernels import cpu as cpu_kernels
from kvyard.models.attention import AttentionMetadata, PrefillSpan, causal_context_mask, paged_attention
from kvyard.models.kv_layer import LayerKV
from kvyard.models.linear import linear, pack_weight
from kvyard.models.rope import apply_rotary

CPU = torch.device("cpu")
needs_packing = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no oneDNN bf16")


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_packed_weight_gives_the_same_bits(rows):
    w, b = torch.randn(96, 80).bfloat16(), torch.randn(96).bfloat16()
    x = torch.randn(rows, 80).bfloat16()
    packed = pack_weight(w)
    assert packed.is_mkldnn
    assert torch.equal(linear(x, packed), F.linear(x, w))
    assert torch.equal(linear(x, packed, b), F.linear(x, w, b))


def test_fp32_weights_stay_plain():
    w = torch.randn(8, 4)
    assert pack_weight(w) is w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_equals_hf_rotate_half_in_place(dtype):
    x = torch.randn(5, 3, 16).to(dtype)
    angles = torch.rand(5, 1, 8) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    rotate_half = torch.cat([-x[..., 8:], x[..., :8]], dim=-1)
    expected = x * cos + rotate_half * sin
    signed_sin = torch.cat([-sin[..., :8], sin[..., 8:]], dim=-1)
    assert torch.equal(apply_rotary(x, cos, signed_sin), expected)
    apply_rotary(x, cos, signed_sin, out=x)
    assert torch.equal(x, expected)


def _reference_attention(q, k, v):
    """One sequence: q [n, heads, d] are the last n positions of k/v [ctx, kv_heads, d]; causal."""
    n, ctx = q.shape[0], k.shape[0]
    mask = causal_context_mask(n, ctx, CPU)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask, enable_gqa=True)
    return o.transpose(0, 1)


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "sdpa"])
@pytest.mark.parametrize("int8", [False, True])
def test_decodes_and_chunks_in_one_step_match_per_sequence_attention(int8, kernel, monkeypatch):
    """Two decodes of different lengths (padded, masked) and a chunk over cached context, in one call."""
    if kernel:
        assert cpu_kernels.available()
    else:
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    torch.manual_seed(0)
    bs, heads, kv_heads, d = 4, 6, 2, 8
    cache = LayerKV.allocate(16 * bs, kv_heads, d, torch.float32, CPU, int8=int8)
    tables = {"a": [3, 7, 1], "b": [5], "c": [2, 9]}  # blocks per sequence
    lengths = {"a": 10, "b": 3, "c": 7}  # tokens after this step
    new = {"a": 1, "b": 1, "c": 3}  # this step: a and b decode, c runs a 3-token chunk
    k_all = {s: torch.randn(n, kv_heads, d) for s, n in lengths.items()}
    v_all = {s: torch.randn(n, kv_heads, d) for s, n in lengths.items()}

    def slots(s, start, end):
        return torch.tensor([tables[s][p // bs] * bs + p % bs for p in range(start, end)])

    for s, n in lengths.items():  # earlier steps' K/V
        cache.write(slots(s, 0, n - new[s]), k_all[s][: n - new[s]], v_all[s][: n - new[s]])
    order = ["a", "b", "c"]
    q = {s: torch.randn(new[s], heads, d) for s in order}
    blocks = torch.tensor([tables["a"], tables["b"] + [0, 0]])
    meta = AttentionMetadata(
        slot_mapping=torch.cat([slots(s, lengths[s] - new[s], lengths[s]) for s in order]),
        block_size=bs, num_decodes=2, decode_blocks=blocks, decode_lens=torch.tensor([lengths["a"], lengths["b"]]),
        prefills=[PrefillSpan(2, 5, slots("c", 0, 7), causal_context_mask(3, 7, CPU))],
    )
    k_new = torch.cat([k_all[s][-new[s]:] for s in order])
    v_new = torch.cat([v_all[s][-new[s]:] for s in order])
    cache.write(meta.slot_mapping, k_new, v_new)
    out = paged_attention(torch.cat([q[s] for s in order]), cache, meta, k_new, v_new)
    expected = torch.cat([_reference_attention(q[s], k_all[s], v_all[s]) for s in order])
    assert torch.allclose(out, expected, atol=0.05 if int8 else 1e-5)


def test_bf16_engine_is_unchanged_by_packing(tiny_checkpoint, monkeypatch):
    path = str(tiny_checkpoint("qwen2"))
    prompt = list(range(3, 40))
    packed = LLM(path, dtype="bfloat16").engine.compute_logits(prompt)
    monkeypatch.setattr(decoder, "pack_weight", lambda w, max_rows=None, gate_up=False: w)
    plain = LLM(path, dtype="bfloat16").engine.compute_logits(prompt)
    assert torch.equal(packed, plain)
