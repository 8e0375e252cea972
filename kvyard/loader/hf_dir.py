"""Open an HF checkpoint directory: config.json, safetensors (one file or sharded) and tokenizer.json."""

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kvyard.errors import CheckpointError, UnsupportedArchitectureError
from kvyard.loader.checkpoint import Checkpoint
from kvyard.loader.generation_defaults import from_generation_config
from kvyard.models.config import ModelConfig
from kvyard.models.moe import expert_tensor_names

INDEX_NAME = "model.safetensors.index.json"

# Per-layer parameters every supported architecture has, relative to `model.layers.{i}.`.
_LAYER_PARAMS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
_BIAS_PARAMS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
_QK_NORM_PARAMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


# Gemma 3's norms around the MLP (its post_attention_layernorm, in _LAYER_PARAMS, norms the attention's output)
_SANDWICH_NORM_PARAMS = ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]


# Multi-head latent attention's projections (deepseek_v2 / v3), in place of q/k/v
_MLA_PARAMS = ["self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight"]
_MLA_Q_LORA_PARAMS = ["self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight"]


def expected_tensor_names(config: ModelConfig) -> list[str]:
    """The HF parameter names the model code consumes for this config, in model order."""
    per_layer = list(_LAYER_PARAMS)
    if config.is_mla:
        per_layer = [p for p in per_layer if p not in ("self_attn.k_proj.weight", "self_attn.v_proj.weight")]
        if config.q_lora_rank:
            per_layer.remove("self_attn.q_proj.weight")
            per_layer += _MLA_Q_LORA_PARAMS
        per_layer += _MLA_PARAMS
    if config.attention_bias:
        per_layer += _BIAS_PARAMS
    if config.qk_norm:
        per_layer += _QK_NORM_PARAMS
    if config.model_type == "gemma3_text":
        per_layer += _SANDWICH_NORM_PARAMS
    if config.qk_norm_whole:
        per_layer += _QK_NORM_PARAMS
    names = ["model.embed_tokens.weight"]
    for i in range(config.num_layers):
        sparse = config.is_sparse(i)
        names += [f"model.layers.{i}.{p}" for p in per_layer if not (sparse and p.startswith("mlp."))]
        if sparse:
            router, experts, shared = expert_tensor_names(config, i)
            names += [router, *(n for e in experts for n in e), *shared]
            if config.router_scoring == "sigmoid":  # deepseek_v3's choice bias
                names.append(router.replace("weight", "e_score_correction_bias"))
    names.append("model.norm.weight")
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def check_tensor_names(present: Iterable[str], config: ModelConfig, where: str, arch: str) -> None:
    """Fail before any weight is read if the checkpoint lacks a tensor the model needs."""
    have = set(present)
    missing = [n for n in expected_tensor_names(config) if n not in have]
    if missing:
        shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise CheckpointError(f"{where}: {arch} checkpoint is missing tensor(s): {shown}")


def architecture_name(hf_config: dict[str, Any]) -> str:
    """What to call the architecture in messages: `LlamaForCausalLM (llama)`."""
    archs = hf_config.get("architectures") or []
    model_type = hf_config.get("model_type", "?")
    return f"{archs[0]} ({model_type})" if archs else str(model_type)


def read_config_json(root: Path) -> dict[str, Any]:
    path = root / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; an HF checkpoint directory needs config.json")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def safetensors_files(root: Path) -> list[Path]:
    """The weight files: those the shard index lists, or every *.safetensors when there is no index."""
    index_path = root / INDEX_NAME
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            shard_names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index_path}: not a valid safetensors index ({e!r})") from e
        missing = [n for n in shard_names if not (root / n).is_file()]
        if missing:
            raise CheckpointError(
                f"{index_path}: lists shard file(s) that do not exist: {', '.join(missing)}"
            )
        return [root / n for n in shard_names]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors weight files (and no {INDEX_NAME})")
    return files


def tensor_locations(files: list[Path]) -> dict[str, Path]:
    """Map each tensor name to its file. Opening every header up front catches broken files early."""
    where: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(f, framework="pt") as sf:
                names = list(sf.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from e
        for n in names:
            where.setdefault(n, f)
    return where


def load_hf_tokenizer(root: Path) -> Any:
    if not (root / "tokenizer.json").is_file():
        raise CheckpointError(
            f"{root / 'tokenizer.json'}: missing; kvyard needs a fast tokenizer (tokenizer.json)"
        )
    # Imported here: transformers is slow to import and only the tokenizer needs it.
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(root))
    except Exception as e:  # transformers raises many types; all mean "this tokenizer is unusable"
        raise CheckpointError(f"{root}: cannot load the tokenizer ({type(e).__name__}: {e})") from e


def _stream(locations: dict[str, Path], wanted: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    by_file: dict[Path, list[str]] = {}
    for name, f in locations.items():
        if name in wanted:
            by_file.setdefault(f, []).append(name)
    # One file open at a time, so a sharded checkpoint never holds every shard's mapping at once.
    for f, names in by_file.items():
        try:
            with safe_open(f, framework="pt") as sf:
                for name in names:
                    yield name, sf.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f}: failed while reading tensors ({e})") from e


def load_hf_dir(path: str | Path) -> Checkpoint:
    """Open an HF checkpoint directory; tensors are read lazily from the safetensors files."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory")
    hf_config = read_config_json(root)
    config = ModelConfig.from_hf(hf_config, source=str(root / "config.json"))
    if hf_config.get("mlp_bias"):
        # The decoder has no MLP biases; loading without them would silently give wrong outputs.
        raise UnsupportedArchitectureError(
            f"{root / 'config.json'}: {architecture_name(hf_config)} with mlp_bias=true is not supported"
        )
    locations = tensor_locations(safetensors_files(root))
    # Only the names the model consumes: a tied checkpoint may still store lm_head.weight, and old
    # llama ones store rotary_emb.inv_freq buffers; neither must reach the model.
    wanted = set(expected_tensor_names(config))
    if "quantization_config" in hf_config:
        return _quantized_checkpoint(root, hf_config, config, locations, wanted)
    check_tensor_names(locations, config, str(root), architecture_name(hf_config))
    return Checkpoint(
        path=root,
        hf_config=hf_config,
        config=config,
        tokenizer=load_hf_tokenizer(root),
        tensors=lambda: _stream(locations, wanted),
        generation_defaults=from_generation_config(root),
    )


def _quantized_checkpoint(root: Path, hf_config: dict[str, Any], config: ModelConfig,
                          locations: dict[str, Path], wanted: set[str]) -> Checkpoint:
    from kvyard.loader.quantized import quantized_stream, read_plan

    plan = read_plan(hf_config, config, str(root / "config.json"))
    dense = wanted - {name + ".weight" for name in plan}
    missing = sorted(n for n in dense if n not in locations)
    missing += sorted(n + ".weight_scale" for n in plan if n + ".weight_scale" not in locations)
    if missing:
        raise CheckpointError(f"{root}: quantized {architecture_name(hf_config)} checkpoint is missing tensor(s): "
                              + ", ".join(missing[:8]))
    return Checkpoint(
        path=root,
        hf_config=hf_config,
        config=config,
        tokenizer=load_hf_tokenizer(root),
        tensors=lambda: quantized_stream(locations, dense, plan, str(root)),
        generation_defaults=from_generation_config(root),
    )
