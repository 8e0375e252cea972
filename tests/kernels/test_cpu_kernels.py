"""The CPU decode-attention kernel against gather + SDPA, the formula it replaces."""

import pytest
import torch
import torch.nn.functional as F

from kvyard.kernels import cpu as cpu_kernels
from kvyard.models.kv_layer import LayerKV
from kvyard.models.rope import apply_rotary


@pytest.fixture(autouse=True)
def kernels():
    # CI machines have a compiler: a build failure must fail here, not fall back unnoticed.
    assert cpu_kernels.available(), "the CPU kernels did not build"


def _reference(q, cache: LayerKV, table, lens, block_size):
    """Per row: gather its slots, dequantize, attend with SDPA in fp32."""
    out = []
    for r in range(q.shape[0]):
        n = int(lens[r])
        slots = torch.tensor([int(table[r, p // block_size]) * block_size + p % block_size for p in range(n)])
        k, v = cache.read_slots(slots, torch.float32)
        o = F.scaled_dot_product_attention(q[r].float().unsqueeze(0).unsqueeze(2),  # [1, heads, 1, d]
                                           k.float().transpose(0, 1).unsqueeze(0),  # [1, kv_heads, n, d]
                                           v.float().transpose(0, 1).unsqueeze(0), enable_gqa=True)
        out.append(o[0, :, 0])
    return torch.stack(out)


def _case(dtype, int8, heads, kv_heads, d, block_size=4, lens=(1, 5, 13, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    rows, width = len(lens), -(-max(lens) // block_size)
    pool = max(64, rows * width)
    cache = LayerKV.allocate(pool * block_size, kv_heads, d, dtype, torch.device("cpu"), int8=int8)
    blocks = torch.randperm(pool, generator=g)[: rows * width].view(rows, width)
    for r, n in enumerate(lens):
        slots = torch.tensor([int(blocks[r, p // block_size]) * block_size + p % block_size for p in range(n)])
        cache.write(slots, torch.randn(n, kv_heads, d, generator=g).to(dtype),
                    torch.randn(n, kv_heads, d, generator=g).to(dtype))
    # q as the engine passes it: a row slice of a wider fused projection.
    qkv = torch.randn(rows, heads + 2 * kv_heads, d, generator=g).to(dtype)
    return qkv[:, :heads], cache, blocks, torch.tensor(lens)


def _kernel(q, cache, blocks, lens, block_size=4):
    return torch.ops.kvyard.paged_decode_attention(q, cache.k, cache.v, cache.k_scale, cache.v_scale, blocks,
                                                   lens, block_size, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 16), (8, 2, 12)])
@pytest.mark.parametrize("int8", [False, True])
def test_fp32_matches_sdpa(heads, kv_heads, d, int8):
    q, cache, blocks, lens = _case(torch.float32, int8, heads, kv_heads, d)
    out = _kernel(q, cache, blocks, lens)
    assert out.shape == q.shape and out.is_contiguous()
    torch.testing.assert_close(out, _reference(q, cache, blocks, lens, 4), atol=1e-5, rtol=1e-5)


# (9, 3, 64) SmolLM2, (14, 2, 64) Qwen2.5-0.5B, (12, 2, 128) Qwen2.5-1.5B, (4, 1, 256) Gemma-3-270M: the
# register-held fast path; (6, 2, 24) the generic loop.
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (14, 2, 64), (12, 2, 128), (4, 1, 256), (6, 2, 24)])
@pytest.mark.parametrize("int8", [False, True])
def test_bf16_is_the_fp32_result_rounded_once(int8, heads, kv_heads, d):
    q, cache, blocks, lens = _case(torch.bfloat16, int8, heads, kv_heads, d, lens=(30, 7, 64))
    out = _kernel(q, cache, blocks, lens)
    assert out.dtype == torch.bfloat16
    expected = _reference(q, cache, blocks, lens, 4)
    # fp32 math inside, one rounding at the end: within one bf16 ulp of the fp32 result.
    assert ((out.float() - expected).abs() <= expected.abs() * 2**-8 + 1e-6).all()


# Contexts past 512 positions are attended in chunks merged by their softmax maxima and sums: the fast path
# (9, 3, 64) and the generic loop (8, 2, 12), one row long enough for three chunks, one for two, one short.
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 1, 256), (8, 2, 12)])
@pytest.mark.parametrize("dtype,int8", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False),
                                        (torch.bfloat16, True)])
def test_long_contexts_match_sdpa(dtype, int8, heads, kv_heads, d):
    q, cache, blocks, lens = _case(dtype, int8, heads, kv_heads, d, block_size=16, lens=(1100, 3, 530))
    out = _kernel(q, cache, blocks, lens, block_size=16)
    expected = _reference(q, cache, blocks, lens, 16)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    else:
        assert ((out.float() - expected).abs() <= expected.abs() * 2**-8 + 1e-6).all()


def test_a_rows_result_does_not_depend_on_its_batch_or_threads():
    # Alone (work split over KV heads and chunks) or among five rows (whole rows per item), on one thread or two,
    # a row's chunks are the same and its result is the same to the bit.
    q, cache, blocks, lens = _case(torch.bfloat16, False, 9, 3, 64, block_size=16, lens=(1100, 40, 700, 5, 530))
    threads = torch.get_num_threads()
    try:
        batched = _kernel(q, cache, blocks, lens, block_size=16)
        for n in (1, 2):
            torch.set_num_threads(n)
            for r in range(q.shape[0]):
                alone = _kernel(q[r : r + 1], cache, blocks[r : r + 1], lens[r : r + 1], block_size=16)
                assert torch.equal(alone[0], batched[r]), (n, r)
    finally:
        torch.set_num_threads(threads)


# A prompt's tokens as rows of one call, each over its own prefix through the prompt's one block table (the
# batch-invariant path's prefill): rows sharing a table are attended in tiles, and each must equal, to the bit,
# the row attended alone as a decode step attends it. Lengths cross the 512-position chunks and end mid-block
# and mid-group-of-four; a decode row of another sequence sits between two runs of the prompt's rows.
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (14, 2, 64), (12, 2, 128), (8, 8, 64), (4, 1, 256)])
@pytest.mark.parametrize("int8", [False, True])
def test_a_prompts_rows_sharing_a_table_equal_each_row_alone(int8, heads, kv_heads, d):
    q, cache, blocks, lens = _case(torch.bfloat16, int8, heads, kv_heads, d, block_size=16, lens=(1030, 77))
    prompt = list(range(490, 530)) + list(range(1003, 1030))
    rows = torch.tensor([0] * 20 + [1] + [0] * (len(prompt) - 20))
    lens = torch.tensor(prompt[:20] + [77] + prompt[20:])
    q = torch.randn(len(rows), heads, d, generator=torch.Generator().manual_seed(1)).bfloat16()
    batched = _kernel(q, cache, blocks[rows], lens, block_size=16)
    for i in range(len(rows)):
        alone = _kernel(q[i : i + 1], cache, blocks[rows[i : i + 1]], lens[i : i + 1], block_size=16)
        assert torch.equal(alone[0], batched[i]), i


def test_padding_entries_of_the_table_are_never_read():
    q, cache, blocks, lens = _case(torch.float32, False, 4, 2, 16, lens=(3, 9))
    before = _kernel(q, cache, blocks, lens)
    blocks[0, 1:] = 10**6  # row 0 holds 3 tokens: only its first block may be read
    assert torch.equal(_kernel(q, cache, blocks, lens), before)


def test_bad_inputs_raise():
    q, cache, blocks, lens = _case(torch.float32, False, 4, 2, 16)
    with pytest.raises(RuntimeError, match="int64"):
        _kernel(q, cache, blocks.int(), lens)
    with pytest.raises(RuntimeError, match="cache dtype"):
        _kernel(q.bfloat16(), cache, blocks, lens)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        torch.ops.kvyard.paged_decode_attention(q[:, :3], cache.k, cache.v, None, None, blocks, lens, 4, 0.25)


def _rtol(dtype: torch.dtype) -> float:
    """fp32: tight. bf16: two ulps (2 * 2^-7), PyTorch's own default for bf16. The kernel reduces the sum of
    squares in another order than PyTorch (8 lanes with AVX2, 16 with AVX-512), which can move the normalised
    value across a rounding boundary (one ulp) before the product with the weight is rounded (a second)."""
    return 1e-5 if dtype == torch.float32 else 1.6e-2


def _hf_rms_norm(x, weight, eps):
    """HF's LlamaRMSNorm: normalise in fp32, cast back, then scale in the model dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 300])
def test_rms_norm_matches_hf(dtype, rows):
    x, w = torch.randn(rows, 576).to(dtype), torch.randn(576).to(dtype)
    out = torch.ops.kvyard.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(out, _hf_rms_norm(x, w, 1e-5), atol=1e-5, rtol=_rtol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_updates_the_residual_like_add_(dtype):
    x, delta, w = torch.randn(5, 64).to(dtype), torch.randn(5, 64).to(dtype), torch.randn(64).to(dtype)
    expected_x = x + delta
    out = torch.ops.kvyard.add_rms_norm_(x, delta, w, 1e-6)
    assert torch.equal(x, expected_x)  # one rounding of the sum, written back in place
    torch.testing.assert_close(out, _hf_rms_norm(expected_x, w, 1e-6), atol=1e-5,
                               rtol=_rtol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(dtype):
    gate_up = (torch.randn(7, 2 * 96) * 6).to(dtype)  # wide enough to reach silu's saturated ends
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    torch.testing.assert_close(torch.ops.kvyard.silu_mul(gate_up), expected, atol=1e-5,
                               rtol=_rtol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul_matches_torch(dtype):
    gate_up = (torch.randn(7, 2 * 96) * 6).to(dtype)  # both tails: gelu's zero and its identity
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.gelu(gate, approximate="tanh") * up  # the activation rounded to dtype first, as here
    torch.testing.assert_close(torch.ops.kvyard.gelu_tanh_mul(gate_up), expected, atol=1e-5, rtol=_rtol(dtype))
    with pytest.raises(RuntimeError, match="supports float32 and bfloat16"):
        torch.ops.kvyard.gelu_tanh_mul(gate_up.double())


def test_norm_and_silu_reject_bad_shapes():
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.kvyard.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.kvyard.rms_norm(torch.randn(8, 2).t(), torch.randn(8), 1e-6)
    with pytest.raises(RuntimeError, match="2 \\* intermediate"):
        torch.ops.kvyard.silu_mul(torch.randn(2, 7))


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_equals_rotary_then_cache_write(dtype, int8):
    heads, kv_heads, d, n = 6, 2, 16, 5
    qkv = torch.randn(n, heads + 2 * kv_heads, d).to(dtype)
    angles = torch.rand(n, d // 2) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)
    slots = torch.tensor([7, 0, 3, 12, 5])
    expected = qkv.clone()
    apply_rotary(expected[:, : heads + kv_heads], cos.unsqueeze(1), sin.unsqueeze(1),
                 out=expected[:, : heads + kv_heads])
    expected_cache = LayerKV.allocate(16, kv_heads, d, dtype, torch.device("cpu"), int8=int8)
    expected_cache.write(slots, expected[:, heads : heads + kv_heads], expected[:, heads + kv_heads :])
    cache = LayerKV.allocate(16, kv_heads, d, dtype, torch.device("cpu"), int8=int8)
    torch.ops.kvyard.rope_write_kv_(qkv, cos, sin, heads, kv_heads, cache.k, cache.v, cache.k_scale, cache.v_scale,
                                    slots)
    assert torch.equal(qkv, expected)  # the same roundings as HF's rotate_half form
    # The cache holds what LayerKV.write stores (int8: the same values and scales as quantize_rows).
    for got, want in zip((cache.k, cache.v, cache.k_scale, cache.v_scale),
                         (expected_cache.k, expected_cache.v, expected_cache.k_scale, expected_cache.v_scale),
                         strict=True):
        assert (got is None and want is None) or torch.equal(got, want)
    with pytest.raises(RuntimeError, match="slot out of range"):
        torch.ops.kvyard.rope_write_kv_(qkv, cos, sin, heads, kv_heads, cache.k, cache.v, cache.k_scale,
                                        cache.v_scale, slots + 16)
