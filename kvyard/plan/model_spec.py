"""The model `kvyard plan` sizes: a known name, a checkpoint directory, a `config.json`, a GGUF file (its header
only), or a description of a model that is not on disk (#38)."""

import json
from dataclasses import dataclass
from typing import Any

from kvyard.errors import ConfigError
from kvyard.models.config import ModelConfig
from kvyard.plan.memory import ModelSize, model_size
from kvyard.quant.plan import expert_units

# --describe keys: the parameter count and the attention shape (GQA: kv_heads and head_dim; a latent cache
# as DeepSeek's: kv_lora_rank and rope_dim)
DESCRIBE_KEYS = {"params", "active_params", "layers", "hidden", "heads", "kv_heads", "head_dim", "kv_lora_rank", "rope_dim",
                 "vocab", "experts", "experts_per_token", "context"}


@dataclass
class PlannedModel:
    name: str
    config: ModelConfig
    size: ModelSize
    active_params: int  # what each token computes with: a Mixture of Experts' chosen experts only


def active_params(cfg: ModelConfig, size: ModelSize) -> int:
    if not cfg.num_experts:
        return size.params
    experts = sum(u.params for u in expert_units(cfg))
    return size.params - experts + experts * cfg.num_experts_per_tok // cfg.num_experts


def from_source(source: str) -> PlannedModel:
    from kvyard.loader.registry import resolve_model

    path = resolve_model(source)
    if path.suffix == ".gguf":
        from kvyard.loader.gguf_file import hf_config_from_gguf, open_reader

        hf = hf_config_from_gguf(open_reader(path), path)
    else:
        config_file = path / "config.json" if path.is_dir() else path
        try:
            hf = json.loads(config_file.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{config_file}: cannot read a model config ({e})", param="model") from e
    cfg = ModelConfig.from_hf(hf, source=str(path))
    size = model_size(cfg)
    return PlannedModel(source, cfg, size, active_params(cfg, size))


def parse_description(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in DESCRIBE_KEYS:
            raise ConfigError(f"--describe wants key=value pairs of {', '.join(sorted(DESCRIBE_KEYS))}; got {item!r}",
                              param="describe")
        try:
            values[key] = float(value)
        except ValueError as e:
            raise ConfigError(f"--describe {key}: not a number: {value!r}", param="describe") from e
    for need in ("params", "layers", "hidden", "heads"):
        if need not in values:
            raise ConfigError(f"--describe needs {need}=", param="describe")
    return values


def described(text: str) -> PlannedModel:
    """A model known by its figures only: its weights are `params` (all counted as matrices in the weight
    format), its KV follows the attention shape given."""
    v = parse_description(text)
    layers, hidden, heads = int(v["layers"]), int(v["hidden"]), int(v["heads"])
    latent = int(v.get("kv_lora_rank", 0))
    fields: dict[str, Any] = dict(
        model_type="deepseek_v3" if latent else "llama", vocab_size=int(v.get("vocab", 32000)), hidden_size=hidden,
        intermediate_size=4 * hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=heads if latent else int(v.get("kv_heads", heads)),
        head_dim=int(v.get("rope_dim", 64)) if latent else int(v.get("head_dim", hidden // heads)),
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=int(v.get("context", 131072)),
        tie_word_embeddings=False, attention_bias=False, qk_norm=False, kv_lora_rank=latent,
        num_experts=int(v.get("experts", 0)), num_experts_per_tok=int(v.get("experts_per_token", 0)))
    cfg = ModelConfig(**fields)
    params = int(v["params"])
    return PlannedModel(f"described ({text})", cfg, ModelSize(params, 0), int(v.get("active_params", params)))


def planned_model(source: str | None, description: str | None) -> PlannedModel:
    if (source is None) == (description is None):
        raise ConfigError("give a model (--model) or a description (--describe), not both", param="model")
    return described(description) if description else from_source(str(source))
