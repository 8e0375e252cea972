"""Gemma 3's text decoder over the same paged cache as DecoderModel.

What differs from the llama family (transformers' Gemma3ForCausalLM is the reference):
- each layer norms its attention's and its MLP's outputs too ("sandwich" norms), and every RMSNorm scales by
  (1 + w); the weights are held as 1 + w, so kvyard's norm kernels apply unchanged;
- the MLP is gelu-tanh(gate) * up;
- the embedding is scaled by sqrt(hidden) (rounded to the model's dtype, as HF does);
- attention scales by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- sliding-window layers (most of them) see only the last `sliding_window` positions and rotate with their own
  RoPE base; the global layers see everything.
"""

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from kvyard.models.attention import AttentionMetadata
from kvyard.models.config import ModelConfig
from kvyard.models.decoder import DecoderModel, LayerWeights, add_rms_norm_, fusable, rms_norm
from kvyard.models.kv_layer import LayerKV
from kvyard.models.linear import Weight, linear
from kvyard.models.rope import RotaryTable


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu-tanh(gate) * up for the fused gate|up projection's output [rows, 2 * intermediate]: one pass of kvyard's
    kernel where it can (2.2x PyTorch's two ops at 32 rows of Gemma-3-270M on an AVX2 EPYC), else PyTorch's."""
    if fusable(gate_up):
        return torch.ops.kvyard.gelu_tanh_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


class Gemma3Model(DecoderModel):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
                 max_rows: int | None = None):
        super().__init__(cfg, dtype, device, max_positions, max_rows)
        local = replace(cfg, rope_theta=cfg.local_rope_theta or cfg.rope_theta, rope_scaling=None)
        self.local_rope = RotaryTable(local, max_positions, device)
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=dtype, device=device)  # rounded as HF's is

    # ---- loading -------------------------------------------------------------------------------------

    def _norm_weight(self, t: torch.Tensor) -> torch.Tensor:
        return t.float().add(1.0).to(self.dtype)  # HF's (1 + w.float()), held once

    def _layer(self, i: int, take: Callable[[str], torch.Tensor], weight: Callable[..., Weight]) -> LayerWeights:
        p = f"model.layers.{i}."
        layer = super()._layer(i, take, weight)
        # The base reads post_attention_layernorm as the norm before the MLP; in Gemma that one is
        # pre_feedforward_layernorm, and post_attention_layernorm norms the attention's output.
        layer.attn_out_norm = layer.post_norm
        layer.post_norm = self._norm_weight(take(p + "pre_feedforward_layernorm.weight"))
        layer.mlp_out_norm = self._norm_weight(take(p + "post_feedforward_layernorm.weight"))
        return layer

    def _decode_stack(self) -> None:  # the fused C++ stack knows neither sandwich norms nor windows
        return None

    # ---- forward -------------------------------------------------------------------------------------

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed) * self.embed_scale

    def rotary(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        full, local = self.rope.lookup(positions, self.dtype), self.local_rope.lookup(positions, self.dtype)
        return [full if layer.window is None else local for layer in self.layers]

    def run_layer(self, x: torch.Tensor, layer: LayerWeights, cache: LayerKV, meta: AttentionMetadata,
                  cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps
        h = self._attention(rms_norm(x, layer.input_norm, eps), layer, cache, meta.windowed(layer.window), cos, sin)
        m = self._mlp(add_rms_norm_(x, rms_norm(h, layer.attn_out_norm, eps), layer.post_norm, eps), layer)
        return x.add_(rms_norm(m, layer.mlp_out_norm, eps))

    def _mlp(self, h: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        return linear(gelu_tanh_mul(linear(h, layer.gate_up)), layer.down)
