"""The model shape kvyard needs, read from an HF `config.json` dict (GGUF metadata is mapped to it)."""

from dataclasses import dataclass, field
from typing import Any

from kvyard.errors import CheckpointError, UnsupportedArchitectureError

# model_type -> the architecture switches our decoder implements.
SUPPORTED_MODEL_TYPES = {
    "llama": {"attention_bias": False, "qk_norm": False},
    "mistral": {"attention_bias": False, "qk_norm": False},
    "qwen2": {"attention_bias": True, "qk_norm": False},
    "qwen3": {"attention_bias": False, "qk_norm": True},
}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = cfg.get("architectures") or [model_type]
            raise UnsupportedArchitectureError(
                f"{source}: architecture {archs} (model_type={model_type!r}) is not supported; "
                f"kvyard implements {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        missing = [k for k in required if k not in cfg]
        if missing:
            raise CheckpointError(f"{source}: {model_type} config is missing {missing}")
        flags = SUPPORTED_MODEL_TYPES[model_type]
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_theta = cfg.get("rope_theta")
        rope_scaling = cfg.get("rope_scaling")
        # transformers 5 folds rope settings into `rope_parameters`.
        rope_params = cfg.get("rope_parameters") or {}
        if rope_theta is None:
            rope_theta = rope_params.get("rope_theta", 10000.0)
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        context = int(cfg.get("max_position_embeddings", 2048))
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type == "mistral") else None
        if window:
            # No sliding-window attention here: keep outputs exact by never exceeding the window.
            context = min(context, int(window))
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=context,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", flags["attention_bias"])),
            qk_norm=flags["qk_norm"],
            rope_scaling=rope_scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
