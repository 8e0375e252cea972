"""Rotary position embeddings, including llama3 and linear frequency scaling."""

import math

import torch

from kvyard.errors import UnsupportedArchitectureError
from kvyard.models.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inverse_frequencies(inv_freq, scaling)
    raise UnsupportedArchitectureError(f"rope scaling {kind!r} is not supported (supported: default, linear, llama3)")


def _llama3_inverse_frequencies(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1 keeps high frequencies, divides low ones by `factor`, and blends the band between.
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryTable:
    """cos/sin for every position, computed once; a step gathers its positions once for all layers.

    The sin table carries rotate-half's sign (-sin on the first half), so that applying the rotation
    needs a roll instead of negate + concatenate.
    """

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device):
        inv_freq = inverse_frequencies(cfg)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.cos = torch.cat([freqs, freqs], dim=-1).cos().to(device)
        self.signed_sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1).to(device)
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Return cos and signed sin shaped [tokens, 1, head_dim] for broadcasting over heads."""
        if dtype not in self._cast:  # cast the tables once, not every step
            self._cast[dtype] = (self.cos.to(dtype), self.signed_sin.to(dtype))
        cos, sin = self._cast[dtype]
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """x: [tokens, heads, head_dim], HF's rotate-half convention; `out` may be x itself (in place).

    rotate_half(x) * sin == roll(x, half) * signed_sin exactly (negation is exact), and each product is
    rounded before the sum, as in HF, so the result is bit-identical to transformers' in any dtype.
    """
    rotated = x.roll(x.shape[-1] // 2, dims=-1).mul_(signed_sin)
    return torch.add(x * cos, rotated, out=out)
