"""Rotary position embeddings, including llama3, linear and YaRN frequency scaling."""

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
    if kind == "yarn":
        return _yarn_inverse_frequencies(cfg, scaling)
    raise UnsupportedArchitectureError(f"rope scaling {kind!r} is not supported (supported: default, linear, llama3, "
                                       "yarn)")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(cfg: ModelConfig, s: dict) -> float:
    # DeepSeek-V3 may leave `factor` out: the ratio of the context to the pretrained one then stands for it
    factor = s.get("factor")
    return float(factor) if factor is not None else cfg.max_position_embeddings / float(
        s["original_max_position_embeddings"])


def attention_factor(cfg: ModelConfig) -> float:
    """What YaRN multiplies cos and sin by (1 for every other scaling): its softer attention at long range."""
    s = cfg.rope_scaling or {}
    if s.get("rope_type", s.get("type")) != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor, mscale, mscale_all_dim = _yarn_factor(cfg, s), s.get("mscale"), s.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def _yarn_inverse_frequencies(cfg: ModelConfig, s: dict) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): high-frequency dimensions keep their frequency, low ones are interpolated by
    `factor`, with a linear ramp between the dimensions that turn beta_fast and beta_slow times in the
    pretrained context; computed as transformers does, so that the tables are bit for bit its own."""
    dim, base, factor = cfg.head_dim, cfg.rope_theta, _yarn_factor(cfg, s)
    old_len = float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


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
        emb, scale = torch.cat([freqs, freqs], dim=-1), attention_factor(cfg)
        self.cos = (emb.cos() * scale).to(device)
        self.signed_sin = (torch.cat([-freqs.sin(), freqs.sin()], dim=-1) * scale).to(device)
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
