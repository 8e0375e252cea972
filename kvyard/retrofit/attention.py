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
