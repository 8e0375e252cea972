"""A speculator on disk: `speculator.json` (what it drafts for, its shape) + `model.safetensors`.

The safetensors file holds only what training changed: the drafter's layers and final norm under HF
names (`model.layers.{i}.…`, `model.norm.weight`) and the draft vocabulary (`draft_token_ids`). The
embeddings and LM head are the target's, so a speculator is only valid for the exact target it was
trained for: the json records the target's fingerprint (a hash of its shape and embedding matrix) and
loading refuses any other target with `SpeculatorMismatchError`.
"""

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kvyard.errors import CheckpointError

CONFIG_NAME = "speculator.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT = "kvyard-speculator"
VERSION = 1
EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
TOKEN_MAP = "draft_token_ids"
LOOKUP_MIN_N, LOOKUP_MAX_N = 2, 4  # prompt lookup before the model: a one-token match is too weak to win


class SpeculatorMismatchError(CheckpointError):
    """A speculator was trained for another target: its layers expect other embeddings."""


@dataclass
class SpeculatorConfig:
    target_name: str  # as given to `kvyard speculator train --target`
    target_fingerprint: str
    hf_config: dict[str, Any]  # the drafter's shape: the target's config with num_hidden_layers = its layers
    init_layers: list[int]  # the target layers its layers started from
    draft_vocab_size: int
    prompt_lookup: bool = True  # try prompt lookup (n-grams of 2..4 tokens) before the model
    training: dict[str, Any] = field(default_factory=dict)  # data, loss, measured acceptance (informative)
    format: str = FORMAT
    version: int = VERSION

    @property
    def num_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])


def target_fingerprint(hf_config: dict[str, Any], embed: torch.Tensor) -> str:
    """sha256 of the target's shape and its float32 embedding matrix (what the drafter's layers were fitted to).
    The architecture's name is left out: a retrofit that rewrites a llama checkpoint as qwen2 with sliding
    windows (kvyard/retrofit/attention.py) keeps the embedding and the hidden states' width the drafter reads."""
    h = hashlib.sha256()
    shape = {k: hf_config.get(k) for k in ("vocab_size", "hidden_size", "num_hidden_layers")}
    h.update(json.dumps(shape, sort_keys=True).encode())
    h.update(embed.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def shared_tensors(tensors, tied: bool) -> dict[str, torch.Tensor]:
    """The target's embedding (and untied LM head) from its tensor stream, stopping as soon as both are seen."""
    want = {EMBED} if tied else {EMBED, HEAD}
    found: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        if name in want:
            if not isinstance(t, torch.Tensor):
                t = t.dequantize()  # a low-bit LM head: the drafter uses it dense
            found[name] = t.float()
            if len(found) == len(want):
                break
    return found


def save_speculator(out: Path, cfg: SpeculatorConfig, weights: dict[str, torch.Tensor]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in weights.items()}, str(out / WEIGHTS_NAME))
    (out / CONFIG_NAME).write_text(json.dumps(asdict(cfg), indent=2) + "\n")


def read_speculator_config(directory: str | Path) -> SpeculatorConfig:
    path = Path(directory).expanduser() / CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file (a speculator directory is made by `kvyard speculator train`)")
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != FORMAT or raw.get("version") != VERSION:
            raise CheckpointError(f"{path}: not a {FORMAT} v{VERSION} config")
        return SpeculatorConfig(**raw)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: unreadable speculator config: {e}") from e


def check_target(cfg: SpeculatorConfig, directory: str | Path, target_name: str, fingerprint: str) -> None:
    if cfg.target_fingerprint != fingerprint:
        raise SpeculatorMismatchError(
            f"{Path(directory).expanduser() / CONFIG_NAME}: this speculator was trained for target "
            f"{cfg.target_name!r} (fingerprint {cfg.target_fingerprint[:12]}), not for {target_name!r} "
            f"(fingerprint {fingerprint[:12]}); train one for it with `kvyard speculator train --target`"
        )


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    path = Path(directory).expanduser() / WEIGHTS_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    return load_file(str(path))
