"""Attention conversions for `kvyard retrofit`, each initialised from the model's own weights, never at random.

`--attention mqa`: fewer KV heads by mean-pooling each group of adjacent KV heads into one (as GQA uptraining
does). Query head h reads KV head h // (heads / kv_heads); the groups nest, so pooling adjacent heads keeps
every query head on the pooled head of its own old one. A model whose heads in a group are already equal is
unchanged by it.
"""

from typing import Any

import torch

from kvyard.errors import ConfigError


def pool_kv_heads(hf_config: dict[str, Any], weights: dict[str, torch.Tensor], kv_heads: int
                  ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The config and weights with `kv_heads` KV heads (k_proj and v_proj weights and biases pooled)."""
    heads = int(hf_config["num_attention_heads"])
    old = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or hf_config["hidden_size"] // heads)
    if kv_heads < 1 or old % kv_heads:
        raise ConfigError(f"--kv-heads {kv_heads} must divide the model's {old} KV heads", param="kv_heads")
    group = old // kv_heads
    out = dict(weights)
    for name, t in weights.items():
        if not (name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight",
                               "self_attn.k_proj.bias", "self_attn.v_proj.bias"))):
            continue
        shaped = t.reshape(kv_heads, group, head_dim, *t.shape[1:])
        out[name] = shaped.mean(1).reshape(kv_heads * head_dim, *t.shape[1:]).to(t.dtype)
    return {**hf_config, "num_key_value_heads": kv_heads}, out


SLIDING_SOURCES = ("llama", "mistral", "qwen2")


def parse_layers(spec: str, num_layers: int) -> list[int]:
    """`all`, or comma-separated layer indices and ranges (`0-5,12`), within the model's layers."""
    if spec == "all":
        return list(range(num_layers))
    layers: set[int] = set()
    try:
        for part in spec.split(","):
            lo, dash, hi = part.strip().partition("-")
            layers.update(range(int(lo), int(hi if dash else lo) + 1))
    except ValueError:
        raise ConfigError(f"--layers {spec!r}: give all, or indices and ranges such as 2-27,29", param="layers") from None
    if not layers or min(layers) < 0 or max(layers) >= num_layers:
        raise ConfigError(f"--layers {spec!r}: the model has layers 0-{num_layers - 1}", param="layers")
    return sorted(layers)


def slide_layers(hf_config: dict[str, Any], weights: dict[str, torch.Tensor], window: int, layers: list[int],
                 sinks: int = 0) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The model as a qwen2 checkpoint whose `layers` attend through a sliding window of `window` positions,
    and to the first `sinks` positions (attention sinks: `sliding_window_sinks`, a key only kvyard reads).

    qwen2 is the llama-family config that HF (and kvyard) reads with per-layer `layer_types`; its q/k/v
    projections carry biases, which a llama or mistral source gets as zeros: the same function, exactly. Every
    weight is the original's; only the attention mask changes."""
    model_type = hf_config.get("model_type")
    if model_type not in SLIDING_SOURCES:
        raise ConfigError(f"--attention swa converts {', '.join(SLIDING_SOURCES)} models, not {model_type!r}",
                          param="attention")
    if window < 1 or sinks < 0:
        raise ConfigError(f"--window {window} must be at least 1, --sinks {sinks} at least 0", param="window")
    if hf_config.get("attention_bias") or hf_config.get("mlp_bias"):
        raise ConfigError("--attention swa: an o_proj or MLP bias has no place in qwen2", param="attention")
    out = dict(weights)
    for i in range(int(hf_config["num_hidden_layers"])):
        for proj in ("q_proj", "k_proj", "v_proj"):
            w = weights[f"model.layers.{i}.self_attn.{proj}.weight"]
            out.setdefault(f"model.layers.{i}.self_attn.{proj}.bias", torch.zeros(w.shape[0], dtype=w.dtype))
    chosen = set(layers)
    kinds = ["sliding_attention" if i in chosen else "full_attention" for i in range(int(hf_config["num_hidden_layers"]))]
    config = {k: v for k, v in hf_config.items() if k not in ("attention_bias", "mlp_bias", "pretraining_tp")}
    config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
                  sliding_window=window, max_window_layers=0, layer_types=kinds)
    if sinks:
        config["sliding_window_sinks"] = sinks
    return config, out
