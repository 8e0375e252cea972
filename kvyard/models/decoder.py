"""The decoder-only transformer shared by llama, mistral, qwen2 and qwen3, over a paged KV cache.

Weights are held fused (q|k|v and gate|up) so that each layer runs four matmuls, which matters on CPU
where per-op overhead adds up over 30 layers.
"""

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from kvyard.errors import CheckpointError
from kvyard.kernels import cpu as cpu_kernels
from kvyard.models.attention import AttentionMetadata, dp_attention_available, paged_attention
from kvyard.models.config import ModelConfig
from kvyard.models.decode_stack import build_decode_stack, run_decode_stack, takes_step
from kvyard.models.huge_pages import move_to_huge_pages, tensors_in
from kvyard.models.kv_layer import LayerKV
from kvyard.models.linear import (
    VnniWeight,
    Weight,
    gated_mlp_input,
    linear,
    pack_weight,
    row_invariant,
)
from kvyard.models.moe import MoeWeights, load_moe, moe_mlp
from kvyard.models.rope import RotaryTable, apply_rotary
from kvyard.quant.qlinear import make_linear
from kvyard.quant.qtensor import QuantizedTensor


def fusable(x: torch.Tensor) -> bool:
    """Whether kvyard's fused CPU kernels take this activation (2-D, dense, fp32 or bf16, on CPU)."""
    return (x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous()
            and x.dtype in (torch.float32, torch.bfloat16) and cpu_kernels.available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if fusable(x) and weight.dtype == x.dtype:
        return torch.ops.kvyard.rms_norm(x, weight, eps)
    # Same order of operations as HF: normalise in fp32, cast back, then scale. F.rms_norm does the
    # fp32 part (x * rsqrt(mean(x^2) + eps)) in one call instead of five.
    normed = F.rms_norm(x.float(), x.shape[-1:], eps=eps)
    return weight * normed.to(x.dtype)


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += delta in place (the residual stream, rounded once as HF's x = x + y), then rms_norm(x)."""
    if fusable(x) and delta.is_contiguous() and delta.dtype == x.dtype == weight.dtype:
        return torch.ops.kvyard.add_rms_norm_(x, delta, weight, eps)
    return rms_norm(x.add_(delta), weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for the fused gate|up projection's output [rows, 2 * intermediate]."""
    if fusable(gate_up):
        return torch.ops.kvyard.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Weight
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None  # qwen3: [heads + kv_heads, head_dim], q_norm's rows then k_norm's
    o: Weight
    post_norm: torch.Tensor
    gate_up: Weight | None  # None in a Mixture-of-Experts layer, which has `moe` instead
    down: Weight | None
    # [heads + kv_heads, head_dim] powers of two on q and k before RoPE, q . k unchanged: set for int8 KV
    # caches (kvyard/quant/kv_smoothing.py), so that large key channels do not coarsen the rest
    qk_scale: torch.Tensor | None = None
    window: int | None = None  # a sliding-window layer's window (ModelConfig.layer_windows)
    # Gemma 3's norms of the attention's and the MLP's outputs, before each joins the residual stream
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    moe: MoeWeights | None = None
    mla: Any = None  # a latent-attention layer's own weights (kvyard/models/deepseek.py LatentAttention)
    lora: dict[str, Any] | None = None  # projection -> the loaded adapters' kvyard.lora.stack.StackedLora
    # Every assignment to any layer's fields, counted: a model rebuilds its decode stack when this moves (the
    # quantizer swaps units in place; int8 KV caches set qk_scale after load).
    edits: ClassVar[int] = 0

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        LayerWeights.edits += 1


class DecoderModel:
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
                 max_rows: int | None = None):
        """`max_rows`: the most tokens a forward pass will carry (the engine's token budget), if known; it
        decides whether weights need a form for prefill-sized matmuls too (see pack_weight)."""
        self.cfg = cfg
        self.max_rows = max_rows
        self.dtype = dtype
        self.device = device
        self.rope = RotaryTable(cfg, max_positions, device)
        self.layers: list[LayerWeights] = []
        self.embed: torch.Tensor | None = None
        self.final_norm: torch.Tensor | None = None
        self.lm_head: Weight | None = None
        self._packed_head: tuple[Weight, Weight] | None = None  # (lm_head, its packed form)
        # (LayerWeights.edits when it was built; the stack, or None where it cannot run these layers)
        self._stack: tuple[int, torch.ScriptObject | None] | None = None
        self.q_size = cfg.num_heads * cfg.head_dim
        self.adapters: Any = None  # kvyard.lora.stack.LoraRegistry, where the engine serves LoRA adapters
        self._adapter_rows: Any = None  # the running step's meta.adapter_rows
        # Set before `load` for --batch-invariant: weights kept plain for one kernel at every row count, and every
        # token's attention taken by the decode kernel, so a row's result depends on nothing but its own context.
        self.batch_invariant = False
        # Set before `load` for --dynamic-quant: low-bit weights in the portable layout, their several-row matmuls
        # on int8-rounded activations (kvyard/quant/qlinear.py PlainLowBitLinear).
        self.dynamic_quant = False

    # ---- loading -------------------------------------------------------------------------------------

    def _weight(self, parts: list[torch.Tensor | QuantizedTensor], source: str) -> Weight:
        """One linear weight from its checkpoint parts (several when fused), dense or low-bit."""
        if all(isinstance(p, torch.Tensor) for p in parts):
            dense = parts[0] if len(parts) == 1 else torch.cat(parts)  # type: ignore[arg-type]
            return dense.contiguous()
        if not all(isinstance(p, QuantizedTensor) for p in parts):
            raise CheckpointError(f"{source}: fused projections mix quantized and dense weights")
        return make_linear(QuantizedTensor.cat(parts), self.dtype, self.device,  # type: ignore[arg-type]
                           row_invariant=self.batch_invariant, int8_activations=self.dynamic_quant)

    def _qk_norm(self, q_norm: torch.Tensor, k_norm: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        return torch.cat([q_norm.expand(cfg.num_heads, -1), k_norm.expand(cfg.num_kv_heads, -1)]).contiguous()

    def load(self, tensors: Iterable[tuple[str, torch.Tensor | QuantizedTensor]], source: str) -> None:
        w = {name: t if isinstance(t, QuantizedTensor) else t.to(device=self.device, dtype=self.dtype)
             for name, t in tensors}
        cfg = self.cfg

        def take(name: str) -> torch.Tensor:
            if name not in w:
                raise CheckpointError(f"{source}: {cfg.model_type} checkpoint is missing tensor {name!r}")
            return w.pop(name)  # type: ignore[return-value]

        def weight(*names: str, gate_up: bool = False) -> Weight:
            return self._pack(self._weight([take(n) for n in names], source), gate_up)

        if self.holds_embedding or (self.holds_head and cfg.tie_word_embeddings):
            self.embed = take("model.embed_tokens.weight")
        if self.holds_head:
            self.final_norm = self._norm_weight(take("model.norm.weight"))
            head = w.pop("lm_head.weight", None) if cfg.tie_word_embeddings else take("lm_head.weight")
            # A quantized head is kept even for tied embeddings: the lookup table stays dense.
            tied = head is None or (cfg.tie_word_embeddings and not isinstance(head, QuantizedTensor))
            self.lm_head = self.embed if tied else self._weight([head], source)  # type: ignore[list-item]
        self.layers = [self._layer(i, take, weight) for i in self.layer_indices()]
        expected = (cfg.vocab_size, cfg.hidden_size)
        if self.embed is not None and tuple(self.embed.shape) != expected:
            raise CheckpointError(
                f"{source}: embed_tokens has shape {tuple(self.embed.shape)}, config says {expected}"
            )
        if self.device.type == "cpu":
            move_to_huge_pages(self.weight_tensors())

    # What of the checkpoint this model holds: every layer, the embedding and the head. A pipeline stage holds
    # its share (kvyard/parallel/pipeline.py); layer indices and weight names stay global.
    holds_embedding = True
    holds_head = True

    def layer_indices(self) -> range:
        return range(self.cfg.num_layers)

    def _norm_weight(self, t: torch.Tensor) -> torch.Tensor:
        """A norm's weight as the kernels take it (x_normed * w); Gemma's (1 + w) overrides this."""
        return t

    def _layer(self, i: int, take: Callable[[str], torch.Tensor], weight: Callable[..., Weight]) -> LayerWeights:
        cfg = self.cfg
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qkv = weight(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
        bias = None
        if cfg.attention_bias:
            bias = torch.cat([take(a + "q_proj.bias"), take(a + "k_proj.bias"), take(a + "v_proj.bias")])
        qk_norm = None
        if cfg.qk_norm:
            qk_norm = self._qk_norm(*(self._norm_weight(take(a + n)) for n in ("q_norm.weight", "k_norm.weight")))
        elif cfg.qk_norm_whole:  # olmoe: [heads * head_dim] then [kv_heads * head_dim]
            qk_norm = torch.cat([take(a + "q_norm.weight"), take(a + "k_norm.weight")])
        sparse = cfg.is_sparse(i)
        return LayerWeights(
            input_norm=self._norm_weight(take(p + "input_layernorm.weight")),
            qkv=qkv,
            qkv_bias=bias,
            qk_norm=qk_norm,
            o=weight(a + "o_proj.weight"),
            post_norm=self._norm_weight(take(p + "post_attention_layernorm.weight")),
            gate_up=None if sparse else weight(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", gate_up=True),
            down=None if sparse else weight(p + "mlp.down_proj.weight"),
            window=cfg.layer_windows[i] if cfg.layer_windows else None,
            moe=load_moe(cfg, i, take, weight, self.dtype) if sparse else None,
        )

    def weight_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor the weights are held in, whatever their form (dense, packed, low-bit)."""
        packed_head = self._packed_head[1] if self._packed_head is not None else None  # packed at first use
        yield from tensors_in([self.embed, self.final_norm, self.lm_head, packed_head])
        for layer in self.layers:
            yield from tensors_in([getattr(layer, f.name) for f in fields(layer)])

    # ---- forward -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[LayerKV],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run one step over a flat batch of tokens; return fp32 logits for the rows in logits_indices."""
        x = self.run_layers(self.embed_inputs(input_ids, meta), positions, meta, kv_caches)
        return self.logits(rms_norm(x[logits_indices], self.final_norm, self.cfg.rms_norm_eps))

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                   kv_caches: list[LayerKV]) -> torch.Tensor:
        """Every layer this model holds on the residual stream `x`, in place (and returned)."""
        ropes = self.rotary(positions)
        rows = self._adapter_rows = meta.adapter_rows
        # Decode rows with adapters run in the stack too (each adds its own adapter's delta); prompt chunks not
        stack = None if rows is not None and rows.segments else \
            self._decode_stack() if cpu_kernels.decode_stack_enabled() and takes_step(x, meta, kv_caches) else None
        if stack is not None and all(meta.windowed(layer.window) is meta for layer in self.layers):
            run_decode_stack(stack, x, meta, kv_caches, *ropes[0], rows.decode_slots if rows is not None else None,
                             self.batch_invariant and dp_attention_available(self.cfg.head_dim))
        else:
            for layer, cache, (cos, sin) in zip(self.layers, kv_caches, ropes, strict=True):
                self.run_layer(x, layer, cache, meta, cos, sin)
        return x

    def logits(self, last: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the final-normed rows `last`."""
        # One row without kvyard's VNNI kernels: the unpacked head through GEMV. For SmolLM2's 57 MB head (2
        # threads) GEMV took 1.9 ms against 3.8 ms for oneDNN's packed layout when both alternated over two
        # copies of the head, and about the same (4.6-5.2 ms) with the caches flushed before each call.
        head = self._head()
        if last.shape[0] == 1 and not isinstance(head, VnniWeight) and not self.batch_invariant:
            head = self.lm_head
        cap = self.cfg.final_logit_softcapping
        if isinstance(head, VnniWeight) and not cap:
            return head.logits(last)
        logits = linear(last, head)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed)

    def embed_inputs(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's input embeddings: its tokens', with soft tokens in their rows. Soft tokens are already in
        the residual stream's space: like HF's `inputs_embeds`, they skip any scaling of the embedding."""
        x = self.embed_tokens(input_ids)
        if meta.soft_embeds is not None:
            rows, values = meta.soft_embeds
            x[rows] = values.to(x.dtype)
        return x

    def rotary(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cos and sin at this step's positions (one table for every layer here)."""
        return [self.rope.lookup(positions, self.dtype)] * len(self.layers)

    def run_layer(self, x: torch.Tensor, layer: LayerWeights, cache: LayerKV, meta: AttentionMetadata,
                  cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One decoder layer on the residual stream `x`, updated in place (and returned): each sum is rounded
        once, as HF's x = x + y is."""
        eps = self.cfg.rms_norm_eps
        h = self._attention(rms_norm(x, layer.input_norm, eps), layer, cache, meta.windowed(layer.window), cos, sin)
        return x.add_(self._mlp(add_rms_norm_(x, h, layer.post_norm, eps), layer))

    def _decode_stack(self) -> torch.ScriptObject | None:
        if self._stack is None or self._stack[0] != LayerWeights.edits:  # a layer changed since it was built
            self._stack = (LayerWeights.edits, build_decode_stack(self))
        return self._stack[1]

    def _head(self) -> Weight:
        # Packed on first use rather than at load: callers may still slice or swap lm_head after loading
        # (a speculator's vocabulary map, the quantizer's unit switch), and a tied head shares the embedding.
        if self._packed_head is None or self._packed_head[0] is not self.lm_head:
            self._packed_head = (self.lm_head, self._pack(self.lm_head))  # type: ignore[arg-type]
        return self._packed_head[1]

    def _pack(self, w: Weight, gate_up: bool = False) -> Weight:
        return row_invariant(w) if self.batch_invariant else pack_weight(w, self.max_rows, gate_up)

    def _attention(self, h: torch.Tensor, layer: LayerWeights, cache: LayerKV, meta: AttentionMetadata,
                   cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        n, heads, kv_heads = h.shape[0], cfg.num_heads, cfg.num_kv_heads
        qkv = self._project(h, layer, "qkv", layer.qkv, layer.qkv_bias).view(n, heads + 2 * kv_heads, cfg.head_dim)
        qk = qkv[:, : heads + kv_heads]
        if layer.qk_norm is not None and cfg.qk_norm_whole:
            q_size = heads * cfg.head_dim
            for part, w in ((qkv[:, :heads], layer.qk_norm[:q_size]), (qkv[:, heads:heads + kv_heads], layer.qk_norm[q_size:])):
                flat = part.reshape(n, -1)  # a view: a row's heads are adjacent
                flat.copy_(rms_norm(flat, w, cfg.rms_norm_eps))
        elif layer.qk_norm is not None:
            qk.copy_(rms_norm(qk, layer.qk_norm, cfg.rms_norm_eps))
        if cfg.clip_qkv is not None:
            qkv.clamp_(-cfg.clip_qkv, cfg.clip_qkv)
        if layer.qk_scale is not None:
            qk.mul_(layer.qk_scale)
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        if fusable(h) and (cache.quantized or cache.k.dtype == qkv.dtype):
            torch.ops.kvyard.rope_write_kv_(qkv, cos, sin, heads, kv_heads, cache.k, cache.v, cache.k_scale,
                                            cache.v_scale, meta.slot_mapping)
        else:
            # RoPE in place on q and k: v stays next to k in the same buffer, and no q/k copies are made.
            apply_rotary(qk, cos, sin, out=qk)
            cache.write(meta.slot_mapping, k, v)
        attn = paged_attention(q, cache, meta, k, v, cfg.attention_scale, self.batch_invariant)
        return self._project(attn.reshape(n, self.q_size), layer, "o", layer.o)

    def _mlp(self, h: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        if layer.moe is not None:
            return moe_mlp(h, layer.moe, silu_mul)
        # oneDNN's fused gate|up (prefill-sized steps) unless this step's adapters change gate|up's output
        adapted = self._adapter_rows is not None and layer.lora is not None and "gate_up" in layer.lora
        gated = None if adapted else gated_mlp_input(h, layer.gate_up)  # type: ignore[arg-type]
        gate_up = silu_mul(self._project(h, layer, "gate_up", layer.gate_up)) if gated is None else gated
        return self._project(gate_up, layer, "down", layer.down)

    def _project(self, h: torch.Tensor, layer: LayerWeights, projection: str, weight: Weight | None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """h @ weight.T (+ bias), plus each of the step's rows' own LoRA delta where this layer has adapters."""
        out = linear(h, weight, bias)  # type: ignore[arg-type]
        if self._adapter_rows is not None and layer.lora is not None and projection in layer.lora:
            layer.lora[projection].add_(out, h, self._adapter_rows)
        return out
