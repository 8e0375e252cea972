"""DeepSeek V2 / V3: multi-head latent attention (MLA) over a paged cache of latents, with routed and shared experts.

Per token and layer the cache keeps what transformers' cache keeps: the normalised KV latent (kv_lora_rank
values) and the one rotary key shared by every head (qk_rope_head_dim), as one row of a single-"head" LayerKV
(`k`; `v` is a view of its latent part). K and V per head are never stored:
- prefill chunks expand their context's latents through kv_b_proj into per-head keys and values and run SDPA,
  as transformers does;
- decodes attend in the latent space instead ("weight absorption"): each head's query is carried into the
  latent by its slice of kv_b_proj (W_UK), every head attends to the same cached rows (one KV head, like MQA),
  and the output is carried back out by the value slice (W_UV). A decode reads kv_lora_rank + rope values per
  cached token, whatever the number of heads.

The checkpoint's rotary rows come in (x0, x1) pairs; they are reordered at load (evens, then odds), so that the
usual rotate-half RoPE computes exactly what transformers' interleaved rotation does.

Where DeepSeek Sparse Attention (V3.2, GLM-5) would plug in, not built yet: a per-layer indexer (a few small
heads with their own cached keys, one more row per token beside the latent) scores every cached position for each
query, and attention reads only the top-k of them. In `_decode` that is a selection of slots before the gather:
the block table's rows become the chosen slots (a table of single slots, as `AttentionMetadata.windowed` builds
for sliding windows), so the latent attention itself is unchanged; prefill chunks take the same top-k as a mask.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kvyard.models.attention import AttentionMetadata
from kvyard.models.config import ModelConfig
from kvyard.models.decoder import DecoderModel, LayerWeights, rms_norm
from kvyard.models.kv_layer import LayerKV
from kvyard.models.linear import Weight, linear, pack_weight
from kvyard.models.moe import load_moe
from kvyard.models.rope import apply_rotary
from kvyard.quant.qtensor import QuantizedTensor


@dataclass
class LatentAttention:
    q_norm: torch.Tensor | None  # q_a_layernorm; None where q comes straight from the hidden state
    q_b: Weight | None  # [heads * (nope + rope), q_lora_rank]
    kv_norm: torch.Tensor  # kv_a_layernorm [kv_lora_rank]
    kv_b: Weight  # [heads * (nope + v), kv_lora_rank]: a latent to each head's key (no RoPE) and value
    w_uk: torch.Tensor  # [heads, nope, kv_lora_rank]: kv_b's key rows, for carrying queries into the latent
    w_uv: torch.Tensor  # [heads, kv_lora_rank, v]: kv_b's value rows, transposed, for carrying outputs out


def mla_cache(slots: int, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> LayerKV:
    """A layer's latent cache: [slots, 1, kv_lora_rank + rope]; `v` views the latent part of the same rows."""
    rows = torch.zeros(slots, 1, cfg.kv_lora_rank + cfg.head_dim, dtype=dtype, device=device)
    return LayerKV(rows, rows[..., : cfg.kv_lora_rank])


def deinterleave(t: torch.Tensor | QuantizedTensor, start: int, stop: int, every: int
                 ) -> torch.Tensor | QuantizedTensor:
    """Rows [start, stop) of each `every` rows of t, reordered from (x0, x1) pairs to evens then odds."""
    perm = torch.arange(t.shape[0])
    for base in range(0, t.shape[0], every):
        span = perm[base + start : base + stop].clone()
        perm[base + start : base + stop] = torch.cat([span[0::2], span[1::2]])
    if isinstance(t, QuantizedTensor):
        def rows(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x[perm]
        return replace(t, q=t.q[perm], scale=t.scale[perm], zero_point=rows(t.zero_point),
                       outliers=rows(t.outliers))
    return t[perm]


class DeepSeekModel(DecoderModel):
    """The base's RoPE table spans cfg.head_dim, which is the rotary key's size here (qk_rope_head_dim)."""

    # ---- loading -------------------------------------------------------------------------------------

    def _layer(self, i: int, take: Callable[[str], torch.Tensor], weight: Callable[..., Weight]) -> LayerWeights:
        cfg = self.cfg
        p = f"model.layers.{i}."
        a = p + "self_attn."
        nope, rope, rank, heads = cfg.qk_nope_head_dim, cfg.head_dim, cfg.kv_lora_rank, cfg.num_heads

        def rotary_last(t: torch.Tensor, every: int) -> torch.Tensor:
            return deinterleave(t, every - rope, every, every) if cfg.rope_interleave else t  # type: ignore[return-value]

        kv_a = rotary_last(take(a + "kv_a_proj_with_mqa.weight"), rank + rope)
        if cfg.q_lora_rank:
            q_in, q_norm = take(a + "q_a_proj.weight"), take(a + "q_a_layernorm.weight")
            q_b = pack_weight(self._weight([rotary_last(take(a + "q_b_proj.weight"), nope + rope)], a), self.max_rows)
        else:
            q_in, q_norm, q_b = rotary_last(take(a + "q_proj.weight"), nope + rope), None, None
        kv_b = take(a + "kv_b_proj.weight")
        dense_kv_b = kv_b.dequantize().to(self.dtype) if isinstance(kv_b, QuantizedTensor) else kv_b
        per_head = dense_kv_b.view(heads, nope + cfg.v_head_dim, rank)
        mla = LatentAttention(
            q_norm=q_norm, q_b=q_b, kv_norm=take(a + "kv_a_layernorm.weight"),
            kv_b=pack_weight(self._weight([kv_b], a), self.max_rows),
            w_uk=per_head[:, :nope].contiguous(), w_uv=per_head[:, nope:].transpose(1, 2).contiguous())
        sparse = cfg.is_sparse(i)
        return LayerWeights(
            input_norm=take(p + "input_layernorm.weight"),
            # q's (or q_a's) rows and the latent's: both read the same normed hidden state, one matmul
            qkv=pack_weight(self._weight([q_in, kv_a], a), self.max_rows),
            qkv_bias=None,
            qk_norm=None,
            o=weight(a + "o_proj.weight"),
            post_norm=take(p + "post_attention_layernorm.weight"),
            gate_up=None if sparse else weight(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", gate_up=True),
            down=None if sparse else weight(p + "mlp.down_proj.weight"),
            moe=load_moe(cfg, i, take, weight, self.dtype) if sparse else None,
            mla=mla,
        )

    def _decode_stack(self) -> None:  # the fused C++ stack knows only per-head K/V caches
        return None

    # ---- forward -------------------------------------------------------------------------------------

    def _attention(self, h: torch.Tensor, layer: LayerWeights, cache: LayerKV, meta: AttentionMetadata,
                   cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg, m = self.cfg, layer.mla
        n, heads, nope, rope, rank = h.shape[0], cfg.num_heads, cfg.qk_nope_head_dim, cfg.head_dim, cfg.kv_lora_rank
        eps = cfg.rms_norm_eps
        a = linear(h, layer.qkv)
        if m.q_b is not None:
            q = linear(rms_norm(a[:, : cfg.q_lora_rank].contiguous(), m.q_norm, eps), m.q_b)
            kv = a[:, cfg.q_lora_rank :]
        else:
            q, kv = a[:, : heads * (nope + rope)].contiguous(), a[:, heads * (nope + rope) :]
        q = q.view(n, heads, nope + rope)
        q_pe = q[..., nope:]
        apply_rotary(q_pe.contiguous(), cos, sin, out=q_pe)
        # One cache row per token: the normed latent, then the rotated shared key.
        row = torch.cat([rms_norm(kv[:, :rank].contiguous(), m.kv_norm, eps),
                         apply_rotary(kv[:, None, rank:].contiguous(), cos, sin)[:, 0]], dim=-1).unsqueeze(1)
        cache.k.index_copy_(0, meta.slot_mapping, row)
        out = torch.empty(n, heads, cfg.v_head_dim, dtype=h.dtype, device=h.device)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], cache, meta, m)
        for span in meta.prefills:
            rows = row[span.start : span.end] if span.context_slots is None else cache.k.index_select(0, span.context_slots)
            out[span.start : span.end] = self._prefill(q[span.start : span.end], rows[:, 0], m, span.mask)
        return linear(out.view(n, heads * cfg.v_head_dim), layer.o)

    def _prefill(self, q: torch.Tensor, rows: torch.Tensor, m: LatentAttention, mask: torch.Tensor | None
                 ) -> torch.Tensor:
        """A chunk against its context's latent rows [ctx, rank + rope], expanded per head as transformers does."""
        cfg = self.cfg
        ctx, heads, nope = rows.shape[0], cfg.num_heads, cfg.qk_nope_head_dim
        kv = linear(rows[:, : cfg.kv_lora_rank].contiguous(), m.kv_b).view(ctx, heads, nope + cfg.v_head_dim)
        k = torch.cat([kv[..., :nope], rows[:, None, cfg.kv_lora_rank :].expand(ctx, heads, cfg.head_dim)], dim=-1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), kv[..., nope:].transpose(0, 1),
                                           attn_mask=mask, is_causal=mask is None, scale=cfg.attention_scale)
        return o.transpose(0, 1)

    def _decode(self, q: torch.Tensor, cache: LayerKV, meta: AttentionMetadata, m: LatentAttention) -> torch.Tensor:
        """Decode rows in the latent space: [nd, heads, nope + rope] queries -> [nd, heads, v]."""
        cfg = self.cfg
        nope, rank = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        nd = q.shape[0]
        q_latent = torch.bmm(q[..., :nope].transpose(0, 1), m.w_uk).transpose(0, 1)  # [nd, heads, rank]
        query = torch.cat([q_latent, q[..., nope:]], dim=-1).unsqueeze(1)  # [nd, 1 (the shared KV head), heads, D]
        blocks = meta.decode_blocks
        width = blocks.shape[1] * meta.block_size  # type: ignore[union-attr]
        rows = cache.k.view(-1, meta.block_size, cache.k.shape[-1])[blocks].view(nd, 1, width, -1)
        o = F.scaled_dot_product_attention(query, rows, rows[..., :rank], attn_mask=meta.decode_mask(q.dtype),
                                           scale=cfg.attention_scale)  # [nd, 1, heads, rank]
        return torch.bmm(o[:, 0].transpose(0, 1), m.w_uv).transpose(0, 1)
