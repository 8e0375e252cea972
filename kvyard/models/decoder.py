"""The decoder-only transformer shared by llama, mistral, qwen2 and qwen3, over a paged KV cache.

Weights are held fused (q|k|v and gate|up) so that each layer runs four matmuls, which matters on CPU
where per-op overhead adds up over 30 layers.
"""

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvyard.errors import CheckpointError
from kvyard.models.attention import AttentionMetadata, paged_attention
from kvyard.models.config import ModelConfig
from kvyard.models.kv_layer import LayerKV
from kvyard.models.rope import RotaryTable, apply_rotary
from kvyard.quant.qlinear import QuantizedLinear, make_linear
from kvyard.quant.qtensor import QuantizedTensor

# A linear layer's weight: a dense [out, in] matrix, or a low-bit one with its own kernel.
Weight = torch.Tensor | QuantizedLinear


def linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
    if not isinstance(w, torch.Tensor):
        y = w(x)
        return y if b is None else y + b
    # oneDNN's bf16 GEMM streams weights at about half the speed of its GEMV at one row; a batch-1
    # decode is pure weight streaming, so it takes the matrix-vector path.
    if x.shape[0] == 1 and x.dtype == torch.bfloat16 and x.device.type == "cpu":
        y = torch.mv(w, x[0]).unsqueeze(0)
        return y if b is None else y + b
    return F.linear(x, w, b)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as HF: normalise in fp32, cast back, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Weight
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Weight
    post_norm: torch.Tensor
    gate_up: Weight
    down: Weight


class DecoderModel:
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int):
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.rope = RotaryTable(cfg, max_positions, device)
        self.layers: list[LayerWeights] = []
        self.embed: torch.Tensor | None = None
        self.final_norm: torch.Tensor | None = None
        self.lm_head: Weight | None = None
        self.q_size = cfg.num_heads * cfg.head_dim

    # ---- loading -------------------------------------------------------------------------------------

    def _weight(self, parts: list[torch.Tensor | QuantizedTensor], source: str) -> Weight:
        """One linear weight from its checkpoint parts (several when fused), dense or low-bit."""
        if all(isinstance(p, torch.Tensor) for p in parts):
            dense = parts[0] if len(parts) == 1 else torch.cat(parts)  # type: ignore[arg-type]
            return dense.contiguous()
        if not all(isinstance(p, QuantizedTensor) for p in parts):
            raise CheckpointError(f"{source}: fused projections mix quantized and dense weights")
        return make_linear(QuantizedTensor.cat(parts), self.dtype, self.device)  # type: ignore[arg-type]

    def load(self, tensors: Iterable[tuple[str, torch.Tensor | QuantizedTensor]], source: str) -> None:
        w = {name: t if isinstance(t, QuantizedTensor) else t.to(device=self.device, dtype=self.dtype)
             for name, t in tensors}
        cfg = self.cfg

        def take(name: str) -> torch.Tensor:
            if name not in w:
                raise CheckpointError(f"{source}: {cfg.model_type} checkpoint is missing tensor {name!r}")
            return w.pop(name)  # type: ignore[return-value]

        def weight(*names: str) -> Weight:
            return self._weight([take(n) for n in names], source)

        self.embed = take("model.embed_tokens.weight")
        self.final_norm = take("model.norm.weight")
        head = w.pop("lm_head.weight", None)
        # A quantized head is kept even for tied embeddings: the lookup table stays dense.
        tied = head is None or (cfg.tie_word_embeddings and not isinstance(head, QuantizedTensor))
        self.lm_head = self.embed if tied else self._weight([head], source)  # type: ignore[list-item]
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = weight(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
            bias = None
            if cfg.attention_bias:
                bias = torch.cat([take(a + "q_proj.bias"), take(a + "k_proj.bias"), take(a + "v_proj.bias")])
            self.layers.append(
                LayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=qkv,
                    qkv_bias=bias,
                    q_norm=take(a + "q_norm.weight") if cfg.qk_norm else None,
                    k_norm=take(a + "k_norm.weight") if cfg.qk_norm else None,
                    o=weight(a + "o_proj.weight"),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=weight(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    down=weight(p + "mlp.down_proj.weight"),
                )
            )
        expected = (cfg.vocab_size, cfg.hidden_size)
        if tuple(self.embed.shape) != expected:
            raise CheckpointError(
                f"{source}: embed_tokens has shape {tuple(self.embed.shape)}, config says {expected}"
            )

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
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        n = input_ids.shape[0]
        cos, sin = self.rope.lookup(positions, self.dtype)
        x = F.embedding(input_ids, self.embed)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            h = rms_norm(x, layer.input_norm, eps)
            qkv = linear(h, layer.qkv, layer.qkv_bias).view(n, -1, cfg.head_dim)
            q, k, v = qkv.split([cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads], dim=1)
            if layer.q_norm is not None:
                q = rms_norm(q, layer.q_norm, eps)
                k = rms_norm(k, layer.k_norm, eps)
                qk = apply_rotary(torch.cat([q, k], dim=1), cos, sin)
            else:
                qk = apply_rotary(qkv[:, : cfg.num_heads + cfg.num_kv_heads], cos, sin)  # q and k in one go
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            attn = paged_attention(q, k, v, cache, meta)
            x = x + linear(attn.view(n, self.q_size), layer.o)
            h = rms_norm(x, layer.post_norm, eps)
            gate, up = linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, layer.down)
        last = rms_norm(x[logits_indices], self.final_norm, eps)
        return linear(last, self.lm_head).float()
