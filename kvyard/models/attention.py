"""Attention over a paged KV cache: one kernel call (or gather + SDPA) for all decodes, SDPA per chunk.

The KV cache of a layer (LayerKV) holds flat slots `[num_blocks * block_size, kv_heads, head_dim]`; a
request's block table maps its positions to slots. A step's tokens are laid out decodes first (one
query each, batched into a single SDPA call), then prefill chunks (one causal SDPA call each).
"""

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from kvyard.kernels import cpu as cpu_kernels
from kvyard.models.kv_layer import LayerKV


@dataclass
class PrefillSpan:
    start: int  # first row of this chunk in the step's token tensor
    end: int
    # Slots of the whole context (earlier chunks + this one); None when the chunk is the whole context,
    # so attention can use the chunk's own K/V without reading the cache back.
    context_slots: torch.Tensor | None
    # [chunk, context] bool: always with context_slots; without them, only where a sliding window cuts the chunk
    mask: torch.Tensor | None
    # The context keys' positions where they are not 0 .. context - 1 shifted: a window's keys after sink tokens
    # (the chunk's queries are the last `chunk` of them); None: contiguous
    key_positions: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] where each new token's K/V is written
    block_size: int = 16
    num_decodes: int = 0
    decode_blocks: torch.Tensor | None = None  # [decodes, max_blocks] block ids (padding points at block 0)
    decode_lens: torch.Tensor | None = None  # [decodes] int64: context length of each decode row
    prefills: list[PrefillSpan] = field(default_factory=list)
    # The sliding layers' own view of the step when they keep KV in a pool of their own (window_blocks.py):
    # their slots and tables; their prefill contexts start at the window's edge.
    window_group: "AttentionMetadata | None" = None
    # Which rows run with which LoRA adapter (kvyard.lora.stack.LoraRows), None: every row the base model's; it
    # travels with the step's metadata so that every layer sees it
    adapter_rows: Any = None
    # Sliding-window layers also see the first `sinks` positions (attention sinks; ModelConfig.sliding_window_sinks)
    sinks: int = 0
    # (rows, embeddings) that replace those rows' token embeddings: soft tokens (kvyard/engine/soft_tokens.py)
    soft_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    _decode_mask: torch.Tensor | None = field(default=None, init=False, repr=False)
    _windowed: dict[int, "AttentionMetadata"] = field(default_factory=dict, init=False, repr=False)
    _invariant: "AttentionMetadata | None" = field(default=None, init=False, repr=False)

    def windowed(self, window: int | None) -> "AttentionMetadata":
        """The step as a sliding-window layer sees it: a query attends to keys fewer than `window` positions
        behind it (HF's kv > q - window). Itself where no query's context reaches past the window; made once
        per step and window, for all the layers that share it."""
        if window is None:
            return self
        if self.window_group is not None:
            return self.window_group.windowed(window)
        if window not in self._windowed:
            self._windowed[window] = self._restricted_to(window)
        return self._windowed[window]

    def _restricted_to(self, window: int) -> "AttentionMetadata":
        spans = [windowed_span(s, window, self.slot_mapping.device, self.sinks) for s in self.prefills]
        long_decodes = self.decode_lens is not None and bool((self.decode_lens > window + self.sinks).any())
        if not long_decodes and all(a is b for a, b in zip(spans, self.prefills, strict=True)):
            return self
        out = AttentionMetadata(self.slot_mapping, self.block_size, self.num_decodes, self.decode_blocks,
                                self.decode_lens, spans, sinks=self.sinks)
        if long_decodes:
            out.decode_blocks, out.decode_lens = window_slots(self.decode_blocks, self.decode_lens, self.block_size,
                                                              window, self.sinks)
            out.block_size = 1
        return out

    def invariant_rows(self) -> "AttentionMetadata":
        """The step with every prompt token as a decode row: its sequence's block table and its own context
        length (its position + 1). The decode kernel then attends each token over its context in the one order
        a decode step would, so the result does not depend on the chunking, on which rows share the step, or on
        whether the context came from the prefix cache: SDPA over a chunk sums in an order set by the chunk's
        shape. Made once per step, for all the layers. Full-attention layers only (the engine refuses the
        batch-invariant path for sliding windows)."""
        if self._invariant is None:
            parts = [(self.decode_blocks, self.decode_lens)] if self.num_decodes else []  # (table, lens) per part
            for span in self.prefills:
                chunk = span.end - span.start
                slots = self.slot_mapping[span.start:span.end] if span.context_slots is None else span.context_slots
                blocks = slots[:: self.block_size] // self.block_size  # a context starts at its first block's slot 0
                lens = torch.arange(len(slots) - chunk + 1, len(slots) + 1, device=slots.device)
                parts.append((blocks.expand(chunk, -1), lens))
            rows, width = sum(t.shape[0] for t, _ in parts), max(t.shape[1] for t, _ in parts)
            assert rows == self.slot_mapping.shape[0], "a step's tokens: its decodes, then its chunks in order"
            table = torch.zeros(rows, width, dtype=torch.int64, device=self.slot_mapping.device)
            row = 0
            for t, _ in parts:
                table[row : row + t.shape[0], : t.shape[1]] = t
                row += t.shape[0]
            lens = torch.cat([n.to(torch.int64) for _, n in parts])
            self._invariant = AttentionMetadata(self.slot_mapping, self.block_size, rows, table, lens)
        return self._invariant

    def decode_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[decodes, 1, 1, max_blocks * block_size] additive mask (0 / -inf) over the padded blocks; made
        once per step, in the model's dtype so that SDPA need not convert it in every layer."""
        if self._decode_mask is None:
            lens = self.decode_lens
            width = self.decode_blocks.shape[1] * self.block_size  # type: ignore[union-attr]
            pad = torch.arange(width, device=lens.device).unsqueeze(0) >= lens.unsqueeze(1)  # type: ignore[union-attr]
            mask = torch.zeros(pad.shape, dtype=dtype, device=pad.device).masked_fill_(pad, float("-inf"))
            self._decode_mask = mask.view(pad.shape[0], 1, 1, width)
        return self._decode_mask


def causal_context_mask(chunk: int, context: int, device: torch.device, window: int | None = None,
                        sinks: int = 0) -> torch.Tensor:
    """Query i of a chunk at the end of `context` keys may see keys 0 .. context - chunk + i (and, with a
    sliding window, none `window` or more positions behind it but the first `sinks`)."""
    k = torch.arange(context, device=device)
    return position_mask(k[context - chunk :], k, window, sinks)


def position_mask(q: torch.Tensor, k: torch.Tensor, window: int | None = None, sinks: int = 0) -> torch.Tensor:
    """[queries, keys] bool from their positions: causal, and within `window` (HF's k > q - window) or among the
    first `sinks` positions."""
    q, k = q.unsqueeze(1), k.unsqueeze(0)
    if window is None:
        return k <= q
    return (k <= q) & ((k > q - window) | (k < sinks))


def windowed_span(span: PrefillSpan, window: int, device: torch.device, sinks: int = 0) -> PrefillSpan:
    """A prefill chunk under a sliding window: itself when no query has keys it hides."""
    chunk = span.end - span.start
    if span.key_positions is not None:
        keys = span.key_positions
        return PrefillSpan(span.start, span.end, span.context_slots,
                           position_mask(keys[-chunk:], keys, window, sinks), keys)
    context = chunk if span.mask is None else span.mask.shape[1]
    if context <= window + sinks:
        return span
    return PrefillSpan(span.start, span.end, span.context_slots,
                       causal_context_mask(chunk, context, device, window, sinks))


def window_slots(blocks: torch.Tensor, lens: torch.Tensor, block_size: int, window: int, sinks: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each decode row's first min(len, sinks) positions and its last ones within the window, as a table of single
    slots (a block size of 1), and their count: the decode kernel then walks only those, with no mask inside a
    block."""
    first = lens.clamp(max=sinks)  # the sink positions each row has
    start = torch.maximum(lens - window, torch.full_like(lens, sinks)).clamp(max=lens)  # the window's first
    count = first + lens - start
    width = int(count.max())
    j = torch.arange(width, device=lens.device).unsqueeze(0)
    pos = torch.where(j < first.unsqueeze(1), j, start.unsqueeze(1) + j - first.unsqueeze(1))
    pos = torch.minimum(pos, (lens - 1).unsqueeze(1))  # past a shorter row's end: padding, never read
    return blocks.gather(1, pos // block_size) * block_size + pos % block_size, count


def paged_attention(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    cache: LayerKV,  # already holding this step's K/V at meta.slot_mapping
    meta: AttentionMetadata,
    k: torch.Tensor,  # [tokens, kv_heads, head_dim], this step's K/V (chunks without context attend to them)
    v: torch.Tensor,
    scale: float | None = None,  # None: head_dim ** -0.5 (SDPA's own default, to the last bit)
    batch_invariant: bool = False,  # every token as a decode row (see invariant_rows)
) -> torch.Tensor:
    """Attention of every token of the step; returns [tokens, heads, head_dim]."""
    nd = meta.num_decodes
    if batch_invariant:  # decodes too in a prompt token's arithmetic
        return rows_attention(q, cache, meta.invariant_rows() if meta.prefills else meta, scale, lone_rows=True)
    if not meta.prefills:  # a pure decode step: no output buffer to assemble
        return decode_attention(q, cache, meta, scale)
    if prompt_tokens_as_rows(q, cache, meta):
        return rows_attention(q, cache, meta.invariant_rows(), scale, lone_rows=False)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = decode_attention(q[:nd], cache, meta, scale)
    for span in meta.prefills:
        out[span.start : span.end] = prefill_attention(q, k, v, cache, span, scale)
    return out


def prompt_tokens_as_rows(q: torch.Tensor, cache: LayerKV, meta: AttentionMetadata) -> bool:
    """Whether this step's prompt chunks go to the decode kernel, every token a row over its own prefix, as on the
    batch-invariant path: where the kernel tiles a prompt's rows (csrc/attend_tile.h), bf16 over a bf16 cache on
    CPU, full attention. It took SDPA's place there at 0.38-0.57x its time for 128- to 512-token prompts, level
    at 2,048 (SmolLM2's heads, 2-core AMD EPYC Zen 3; BENCHMARKS.md), and it makes a prompt token's attention the same whatever
    the chunking and the prefix cache. fp32 keeps SDPA, as HF computes it; an int8 cache keeps SDPA over the
    chunk's own unrounded K/V."""
    if q.device.type != "cpu" or q.dtype != torch.bfloat16 or cache.k.dtype != torch.bfloat16:
        return False
    if any(span.mask is not None for span in meta.prefills):  # sliding windows and sinks
        return False
    return prompt_tiles_fit(q.shape[2], q.shape[1] // cache.k.shape[1])


@functools.cache
def prompt_tiles_fit(head_dim: int, group: int) -> bool:
    """Whether this CPU's kernels tile a prompt's rows for this head size and query heads per KV head."""
    return cpu_kernels.prompt_attention_tiles(head_dim, group)


def rows_attention(q: torch.Tensor, cache: LayerKV, rows: AttentionMetadata, scale: float | None,
                   lone_rows: bool) -> torch.Tensor:
    """Every token of the step a row over its own prefix (`rows`: meta.invariant_rows(), or a decode step's meta).
    With AVX512-BF16, a bf16 prompt's rows go to csrc/attend_tile_dp.h (two VDPBF16PS products a tile, bf16 softmax
    weights: 0.35-0.5x the fp32 tiles' time at 128-2,048 tokens on a Zen 4 EPYC), and lone rows (decodes) too
    where `lone_rows` (the batch-invariant path, so that a token's attention is the same as either; a decode step
    1.01-1.03x the decode kernel's time at 1-32 rows), else to the decode kernel. Elsewhere every row goes to the
    decode kernel."""
    if not dp_attention_fits(q, cache):
        return decode_attention(q, cache, rows, scale)
    return torch.ops.kvyard.paged_attention_dp(
        q, cache.k, cache.v, rows.decode_blocks, rows.decode_lens, rows.block_size,
        q.shape[2] ** -0.5 if scale is None else scale, lone_rows)


def dp_attention_fits(q: torch.Tensor, cache: LayerKV) -> bool:
    """Whether rows_attention takes AVX512-BF16 products here: bf16 queries over a bf16 cache on such a CPU."""
    return (q.device.type == "cpu" and q.dtype == torch.bfloat16 and cache.k.dtype == torch.bfloat16
            and dp_attention_available(q.shape[2]))


@functools.cache
def dp_attention_available(head_dim: int) -> bool:
    return cpu_kernels.attention_dp_available(head_dim)


def decode_attention(q: torch.Tensor, cache: LayerKV, meta: AttentionMetadata, scale: float | None = None
                     ) -> torch.Tensor:
    """One query per row against its whole context: on CPU one kernel call that reads K/V in place through
    the block tables; otherwise one SDPA call over the gathered, padded and masked blocks."""
    nd, heads, head_dim = q.shape
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and cpu_kernels.available():
        return torch.ops.kvyard.paged_decode_attention(
            q, cache.k, cache.v, cache.k_scale, cache.v_scale, meta.decode_blocks, meta.decode_lens,
            meta.block_size, head_dim**-0.5 if scale is None else scale)
    blocks = meta.decode_blocks
    width = blocks.shape[1] * meta.block_size  # type: ignore[union-attr]
    k, v = cache.read_blocks(blocks.view(-1), meta.block_size, q.dtype)  # type: ignore[union-attr]
    kv_heads = k.shape[1]
    k = k.view(nd, width, kv_heads, head_dim).transpose(1, 2)
    v = v.view(nd, width, kv_heads, head_dim).transpose(1, 2)
    # The query heads sharing a KV head become that head's query rows ([nd, kv_heads, group, head_dim]):
    # one single-query attention per (row, query head) becomes one per (row, KV head), a third of the
    # calls for SmolLM2, and SDPA's per-call cost is most of a decode step's attention on CPU.
    qg = q.view(nd, kv_heads, heads // kv_heads, head_dim)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=meta.decode_mask(q.dtype), scale=scale)
    return o.reshape(nd, heads, head_dim)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV,
                      span: PrefillSpan, scale: float | None = None) -> torch.Tensor:
    """A chunk's causal attention over its own K/V, or over its whole cached context."""
    qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0)
    if span.context_slots is None:
        ks, vs = k[span.start : span.end], v[span.start : span.end]
    else:
        ks, vs = cache.read_slots(span.context_slots, q.dtype)
    o = F.scaled_dot_product_attention(
        qs,
        ks.transpose(0, 1).unsqueeze(0),
        vs.transpose(0, 1).unsqueeze(0),
        attn_mask=span.mask,
        is_causal=span.mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return o.squeeze(0).transpose(0, 1)
