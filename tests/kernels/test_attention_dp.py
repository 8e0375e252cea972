"""torch.ops.kvyard.paged_attention_dp (csrc/attend_tile_dp.h): a prompt's rows as VDPBF16PS products, on CPUs
with AVX512-BF16. Its results are as close to exact attention as the decode kernel's fp32 chain; with lone_rows,
every row (a prompt token in a tile, a decode alone) has the same arithmetic, to the bit."""

import pytest
import torch

from kvyard.kernels import cpu as cpu_kernels
from tests.kernels.test_cpu_kernels import _case, _kernel, _reference

pytestmark = pytest.mark.skipif(not (cpu_kernels.available() and cpu_kernels.attention_dp_available(64)),
                                reason="needs kvyard's CPU kernels built for AVX512-BF16")


def _dp(q, cache, blocks, lens, block_size=16, lone_rows=True):
    return torch.ops.kvyard.paged_attention_dp(q, cache.k, cache.v, blocks, lens, block_size, q.shape[-1] ** -0.5,
                                               lone_rows)


def _prompt(heads, kv_heads, d, tokens, context=0, seed=0):
    """One sequence of context + tokens cached positions, and its last `tokens` as prompt rows over their prefixes."""
    q, cache, blocks, _ = _case(torch.bfloat16, False, heads, kv_heads, d, block_size=16, lens=(context + tokens,),
                                seed=seed)
    rows = torch.randn(tokens, heads, d, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    lens = torch.arange(context + 1, context + tokens + 1)
    return rows, cache, blocks.expand(tokens, -1).contiguous(), lens


@pytest.mark.parametrize("heads,kv_heads,d,tokens,context", [
    (9, 3, 64, 1, 0), (9, 3, 64, 37, 0), (9, 3, 64, 130, 5), (14, 2, 64, 40, 600), (12, 2, 128, 33, 17),
    (8, 8, 64, 20, 0)])
def test_as_close_to_exact_attention_as_the_fp32_kernel(heads, kv_heads, d, tokens, context):
    """Against attention in fp32 over the same bf16 values: the bf16 weights add little to the output's own
    rounding, so the error stays within twice the fp32 kernel's (contexts past 512 positions are cut into chunks
    and merged)."""
    q, cache, blocks, lens = _prompt(heads, kv_heads, d, tokens, context)
    exact = _reference(q, cache, blocks, lens, 16)
    fp32_err = (_kernel(q, cache, blocks, lens, block_size=16).float() - exact).abs().max().item()
    for lone_rows in (False, True):
        out = _dp(q, cache, blocks, lens, lone_rows=lone_rows)
        assert out.shape == q.shape and not out.isnan().any()
        assert (out.float() - exact).abs().max().item() <= 2 * fp32_err + 2e-3


def test_a_prompts_rows_equal_each_row_alone_with_lone_rows():
    """The batch-invariant path: a prompt token's row in a tile of 16 equals the same row attended alone, as a
    decode step attends it, across 512-position chunks and with a decode row of another sequence in between."""
    q, cache, blocks, lens = _case(torch.bfloat16, False, 9, 3, 64, block_size=16, lens=(1030, 77))
    prompt = list(range(490, 530)) + list(range(1003, 1030))
    rows = torch.tensor([0] * 20 + [1] + [0] * (len(prompt) - 20))
    lens = torch.tensor(prompt[:20] + [77] + prompt[20:])
    q = torch.randn(len(rows), 9, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    batched = _dp(q, cache, blocks[rows], lens)
    for i in range(len(rows)):
        alone = _dp(q[i : i + 1], cache, blocks[rows[i : i + 1]], lens[i : i + 1])
        assert torch.equal(alone[0], batched[i]), i


def test_without_lone_rows_a_decode_row_keeps_the_decode_kernels_result():
    q, cache, blocks, lens = _case(torch.bfloat16, False, 9, 3, 64, block_size=16, lens=(300, 45, 700))
    assert torch.equal(_dp(q, cache, blocks, lens, lone_rows=False), _kernel(q, cache, blocks, lens, block_size=16))
    assert not torch.equal(_dp(q, cache, blocks, lens, lone_rows=True),
                           _kernel(q, cache, blocks, lens, block_size=16))  # the other arithmetic, where asked


def test_unwritten_slots_past_the_context_are_never_read():
    """Positions past a tile's longest row are zeros in its rearranged context, whatever the pool holds there."""
    q, cache, blocks, lens = _prompt(9, 3, 64, 21)  # 21 positions: 11 of the second block's slots are unwritten
    before = _dp(q, cache, blocks, lens)
    unwritten = blocks[0, 1] * 16 + torch.arange(5, 16)
    cache.k[unwritten] = float("nan")
    cache.v[unwritten] = float("nan")
    assert torch.equal(_dp(q, cache, blocks, lens), before)


def test_bad_inputs_raise():
    q, cache, blocks, lens = _case(torch.float32, False, 9, 3, 64)
    with pytest.raises(RuntimeError, match="bf16"):
        _dp(q, cache, blocks, lens, block_size=4)
