"""PEFT LoRA adapters, read for kvyard's layers (#39).

The format is PEFT's: `adapter_config.json` beside `adapter_model.safetensors`, whose tensors are named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`, A of [r, in] and B of [out, r].
A module's rank and alpha come from `rank_pattern` / `alpha_pattern` where a pattern matches its name (as PEFT
matches them), else from `r` / `lora_alpha`; its scale is alpha / r, or alpha / sqrt(r) with rsLoRA. What this
reader does not apply (DoRA, trained biases, modules saved whole, adapted embeddings or heads) is refused with
the file and the reason, never read as something else.

An adapter's identity is a digest of its content, not its name: the prefix cache keys its blocks by it, so an
adapter reloaded under the same name with new weights never meets the old one's KV.
"""

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kvyard.errors import CheckpointError
from kvyard.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The model families whose layers kvyard adapts: the plain dense decoders
LORA_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# The modules an adapter may target: the dense llama-family projections kvyard runs
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TENSOR_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# Settings PEFT may write that this reader cannot honour, with the value each must have
REFUSED = {"use_dora": False, "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
           "use_qalora": False, "lora_bias": False}


class AdapterError(CheckpointError):
    """A LoRA adapter that cannot be served as it is: the message names the file and the reason."""


@dataclass(frozen=True)
class LoraModule:
    a: torch.Tensor  # [rank, in], float32
    b: torch.Tensor  # [out, rank], float32, already times the module's scale

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoraAdapter:
    name: str
    path: Path
    digest: str  # sha256 of the config and the weights, hex
    modules: dict[tuple[int, str], LoraModule]  # (layer index, module name) -> its low-rank pair

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def nbytes(self) -> int:
        return sum(m.a.numel() + m.b.numel() for m in self.modules.values()) * 4


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(out, in) of a dense layer's projection."""
    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (inter, h),
            "up_proj": (inter, h), "down_proj": (h, inter)}[module]


def pattern_value(patterns: dict[str, float], name: str, default: float) -> float:
    """The value of the first pattern that names `name` exactly or matches its end (PEFT's rule)."""
    for key, value in patterns.items():
        if key == name or re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _config(path: Path) -> dict:
    file = path / CONFIG_FILE
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError as e:
        raise AdapterError(f"{file}: missing; a PEFT LoRA adapter has {CONFIG_FILE} and {WEIGHTS_FILE}") from e
    except (OSError, ValueError) as e:
        raise AdapterError(f"{file}: not readable JSON ({e})") from e
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{file}: peft_type {config.get('peft_type') if isinstance(config, dict) else None!r} "
                           f"is not LORA")
    for key, allowed in REFUSED.items():
        if config.get(key, allowed) not in (allowed, [], {}):
            raise AdapterError(f"{file}: {key}={config[key]!r} is not supported (only {allowed!r})")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(MODULES))
        if unknown:
            raise AdapterError(f"{file}: target module(s) {', '.join(unknown)} are not supported; an adapter may "
                               f"target {', '.join(MODULES)}")
    return config


def _targeted(config: dict, name: str) -> bool:
    targets = config.get("target_modules")
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return not targets or any(name == t or name.endswith("." + t) for t in targets)


def load_adapter(name: str, path: str | Path, cfg: ModelConfig) -> LoraAdapter:
    """Read and check the adapter at `path` against the base model `cfg`."""
    path = Path(path)
    config = _config(path)
    file = path / WEIGHTS_FILE
    try:
        tensors = load_file(file)
    except FileNotFoundError as e:
        raise AdapterError(f"{file}: missing; a PEFT LoRA adapter has {CONFIG_FILE} and {WEIGHTS_FILE}") from e
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"{file}: not a readable safetensors file ({e})") from e
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, t in tensors.items():
        m = TENSOR_NAME.fullmatch(tensor_name)
        if m is None or m.group(2) not in MODULES:
            raise AdapterError(f"{file}: tensor {tensor_name!r} is not a LoRA pair of a module kvyard adapts "
                               f"({', '.join(MODULES)} of a decoder layer)")
        layer, module = int(m.group(1)), m.group(2)
        if layer >= cfg.num_layers:
            raise AdapterError(f"{file}: {tensor_name!r} adapts layer {layer}; the base model has {cfg.num_layers}")
        pairs.setdefault((layer, module), {})[m.group(3)] = t
    if not pairs:
        raise AdapterError(f"{file}: holds no LoRA weights")
    modules = {key: _module(file, config, cfg, key, pair) for key, pair in sorted(pairs.items())}
    digest = hashlib.sha256((path / CONFIG_FILE).read_bytes() + file.read_bytes()).hexdigest()
    return LoraAdapter(name, path, digest, modules)


def _module(file: Path, config: dict, cfg: ModelConfig, key: tuple[int, str], pair: dict[str, torch.Tensor]
            ) -> LoraModule:
    layer, module = key
    full = f"model.layers.{layer}.{'mlp' if module in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{module}"
    if set(pair) != {"A", "B"}:
        raise AdapterError(f"{file}: {full} has lora_{''.join(pair)} without its pair")
    if not _targeted(config, full):
        raise AdapterError(f"{file}: {full} has weights but is not among target_modules {config.get('target_modules')!r}")
    rank = int(pattern_value(config.get("rank_pattern") or {}, full, config.get("r", 8)))
    alpha = float(pattern_value(config.get("alpha_pattern") or {}, full, config.get("lora_alpha", 8)))
    out_features, in_features = module_shape(cfg, module)
    a, b = pair["A"], pair["B"]
    if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
        raise AdapterError(f"{file}: {full} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; rank {rank} on "
                           f"this model needs {(rank, in_features)} and {(out_features, rank)}")
    scale = alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank
    return LoraModule(a.float().contiguous(), (b.float() * scale).contiguous())
