"""Sliding-window attention: a windowed layer's view of a step equals attention with HF's window mask, and the
engine's caching, chunking and speculation stay exact with windows (Gemma 3 in small against transformers)."""

import pytest
import torch
import torch.nn.functional as F

from kvyard import LLM, SamplingParams
from kvyard.models.attention import AttentionMetadata, paged_attention
from kvyard.models.kv_layer import LayerKV
from tests.conftest import hf_greedy, hf_reference

WINDOW, BLOCK = 7, 4


def _reference(q, keys, values, length):
    """One decode row at position length - 1: SDPA over the keys fewer than WINDOW positions behind it."""
    lo = max(0, length - WINDOW)
    k, v = keys[lo:length].transpose(0, 1), values[lo:length].transpose(0, 1)
    group = q.shape[0] // k.shape[0]
    return F.scaled_dot_product_attention(q.unsqueeze(1), k.repeat_interleave(group, 0),
                                          v.repeat_interleave(group, 0)).squeeze(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windowed_decodes_see_only_the_window(dtype):
    torch.manual_seed(0)
    lens = [3, 7, 8, 13, 30]  # shorter than, equal to and past the window, across block edges
    heads, kv_heads, dim, nblocks = 4, 2, 16, 64
    cache = LayerKV(torch.zeros(nblocks * BLOCK, kv_heads, dim, dtype=dtype),
                    torch.zeros(nblocks * BLOCK, kv_heads, dim, dtype=dtype))
    perm = torch.randperm(nblocks)  # blocks scattered over the pool, as after reuse
    tables, rows = [], []
    for i, n in enumerate(lens):
        blocks = perm[i * 8: i * 8 + -(-n // BLOCK)].tolist()
        slots = torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
        keys, values = torch.randn(n, kv_heads, dim, dtype=dtype), torch.randn(n, kv_heads, dim, dtype=dtype)
        cache.k[slots], cache.v[slots] = keys, values
        tables.append(blocks + [0] * (8 - len(blocks)))
        rows.append((keys, values))
    q = torch.randn(len(lens), heads, dim, dtype=dtype)
    meta = AttentionMetadata(slot_mapping=torch.zeros(len(lens), dtype=torch.long), block_size=BLOCK,
                             num_decodes=len(lens), decode_blocks=torch.tensor(tables),
                             decode_lens=torch.tensor(lens))
    windowed = meta.windowed(WINDOW)
    assert windowed is not meta and windowed.decode_lens.tolist() == [min(n, WINDOW) for n in lens]
    assert meta.windowed(64) is meta  # no row reaches past a long window: the full view serves
    got = paged_attention(q, cache, windowed, q, q)
    for i, (n, (keys, values)) in enumerate(zip(lens, rows, strict=True)):
        want = _reference(q[i].float(), keys.float(), values.float(), n)
        torch.testing.assert_close(got[i].float(), want, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)


PROMPT_TEXTS = ["The quick brown fox jumps over the lazy dog. The quick brown",
                "Paged attention keeps the KV cache in fixed-size blocks. Paged attention"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def test_gemma3_prefix_hits_and_speculation_stay_exact(tiny_checkpoint):
    path = tiny_checkpoint("gemma3_text", True)
    ref = hf_reference(path)
    plain = LLM(str(path), dtype="float32", block_size=BLOCK, max_num_batched_tokens=64)
    prompts = [plain.tokenizer(t).input_ids for t in PROMPT_TEXTS]
    want = [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]
    first = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)]
    # The same prompts again, and each extended by its own answer: their prefixes come from the cache.
    hits = plain.engine.blocks.hit_tokens
    again = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)]
    assert first == want and again == want
    longer = [p + w for p, w in zip(prompts, want, strict=True)]
    assert [o.outputs[0].token_ids for o in plain.generate(longer, GREEDY)] == [
        hf_greedy(ref, p, GREEDY.max_tokens) for p in longer]
    assert plain.engine.blocks.hit_tokens - hits >= 2 * len(prompts) * BLOCK
    spec = LLM(str(path), dtype="float32", block_size=BLOCK, max_num_batched_tokens=64, speculative_method="ngram")
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, GREEDY)] == want
    assert spec.engine.spec.stats.accepted_tokens > 0
