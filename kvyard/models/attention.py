"""Attention over a paged KV cache: gather the context's slots, then one SDPA call per group.

The KV cache of a layer (LayerKV) holds flat slots `[num_blocks * block_size, kv_heads, head_dim]`; a
request's block table maps its positions to slots. A step's tokens are laid out decodes first (one
query each, batched into a single SDPA call), then prefill chunks (one causal SDPA call each).
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvyard.models.kv_layer import LayerKV


@dataclass
class PrefillSpan:
    start: int  # first row of this chunk in the step's token tensor
    end: int
    # Slots of the whole context (earlier chunks + this one); None when the chunk is the whole context,
    # so attention can use the chunk's own K/V without reading the cache back.
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None  # [chunk, context] bool, only with context_slots


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] where each new token's K/V is written
    block_size: int = 16
    num_decodes: int = 0
    decode_blocks: torch.Tensor | None = None  # [decodes, max_blocks] block ids (padding points at block 0)
    decode_mask: torch.Tensor | None = None  # [decodes, 1, 1, max_blocks * block_size] bool, True = attend
    prefills: list[PrefillSpan] = field(default_factory=list)


def causal_context_mask(chunk: int, context: int, device: torch.device) -> torch.Tensor:
    """Query i of a chunk at the end of `context` keys may see keys 0 .. context - chunk + i."""
    q = torch.arange(chunk, device=device).unsqueeze(1) + (context - chunk)
    k = torch.arange(context, device=device).unsqueeze(0)
    return k <= q


def paged_attention(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k: torch.Tensor,  # [tokens, kv_heads, head_dim] (new tokens only)
    v: torch.Tensor,
    cache: LayerKV,
    meta: AttentionMetadata,
) -> torch.Tensor:
    cache.write(meta.slot_mapping, k, v)
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        # Grouped-query trick: a decode query's heads that share one KV head become that head's
        # "query rows", so SDPA needs no repeated K/V.
        group = heads // kv_heads
        qd = q[:nd].view(nd, kv_heads, group, head_dim)
        width = meta.decode_blocks.shape[1] * meta.block_size
        kd, vd = cache.read_blocks(meta.decode_blocks.view(-1), meta.block_size, q.dtype)
        kd, vd = kd.view(nd, width, kv_heads, head_dim), vd.view(nd, width, kv_heads, head_dim)
        od = F.scaled_dot_product_attention(
            qd, kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=meta.decode_mask
        )
        out[:nd] = od.reshape(nd, heads, head_dim)
    for span in meta.prefills:
        qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0)
        if span.context_slots is None:
            ks, vs, mask, causal = k[span.start : span.end], v[span.start : span.end], None, True
        else:
            ks, vs = cache.read_slots(span.context_slots, q.dtype)
            mask, causal = span.mask, False
        os_ = F.scaled_dot_product_attention(
            qs,
            ks.transpose(0, 1).unsqueeze(0),
            vs.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            enable_gqa=True,
        )
        out[span.start : span.end] = os_.squeeze(0).transpose(0, 1)
    return out
