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
from kvyard.models.rope import RotaryTable, apply_rotary


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
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
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class DecoderModel:
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int):
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.rope = RotaryTable(cfg, max_positions, device)
        self.layers: list[LayerWeights] = []
        self.embed: torch.Tensor | None = None
        self.final_norm: torch.Tensor | None = None
        self.lm_head: torch.Tensor | None = None
        self.q_size = cfg.num_heads * cfg.head_dim

    # ---- loading -------------------------------------------------------------------------------------

    def load(self, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        w = {name: t.to(device=self.device, dtype=self.dtype) for name, t in tensors}
        cfg = self.cfg

        def take(name: str) -> torch.Tensor:
            if name not in w:
                raise CheckpointError(f"{source}: {cfg.model_type} checkpoint is missing tensor {name!r}")
            return w.pop(name)

        self.embed = take("model.embed_tokens.weight")
        self.final_norm = take("model.norm.weight")
        head = w.pop("lm_head.weight", None)
        self.lm_head = self.embed if head is None or cfg.tie_word_embeddings else head
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = torch.cat([take(a + "q_proj.weight"), take(a + "k_proj.weight"), take(a + "v_proj.weight")])
            bias = None
            if cfg.attention_bias:
                bias = torch.cat([take(a + "q_proj.bias"), take(a + "k_proj.bias"), take(a + "v_proj.bias")])
            self.layers.append(
                LayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=qkv.contiguous(),
                    qkv_bias=bias,
                    q_norm=take(a + "q_norm.weight") if cfg.qk_norm else None,
                    k_norm=take(a + "k_norm.weight") if cfg.qk_norm else None,
                    o=take(a + "o_proj.weight"),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
                    down=take(p + "mlp.down_proj.weight"),
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
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run one step over a flat batch of tokens; return fp32 logits for the rows in logits_indices."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        n = input_ids.shape[0]
        cos, sin = self.rope.lookup(positions, self.dtype)
        x = F.embedding(input_ids, self.embed)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
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
            attn = paged_attention(q, k, v, k_cache, v_cache, meta)
            x = x + linear(attn.view(n, self.q_size), layer.o)
            h = rms_norm(x, layer.post_norm, eps)
            gate, up = linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, layer.down)
        last = rms_norm(x[logits_indices], self.final_norm, eps)
        return linear(last, self.lm_head).float()
