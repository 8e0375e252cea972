"""`graft.json`: what a graft directory holds, written by `kvyard graft vision` and read by `kvyard serve`."""

import json
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from kvyard.errors import CheckpointError

CONFIG_FILE = "graft.json"
PROJECTOR_FILE = "projector.safetensors"


@dataclass
class GraftConfig:
    model: str  # the frozen language model: a registry name or a path (kvyard.loader.registry.resolve_model)
    encoder: str  # the frozen encoder's weights: a registry name or a path
    tokens: int  # soft tokens per image
    width: int  # the projector's hidden layer
    feature_dim: int  # the encoder's channels
    hidden: int  # the language model's embedding width
    placeholder: str  # the text that marks an image in the templated prompt
    placeholder_id: int  # the token id each soft token's position holds
    image_size: int = 64  # images are resized to this square before encoding (the training images' size)

    def write(self, directory: Path) -> None:
        (directory / CONFIG_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, directory: str | Path) -> "GraftConfig":
        path = Path(directory).expanduser() / CONFIG_FILE
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: not a readable graft config ({e})") from e
        required = {f.name for f in fields(cls) if f.default is MISSING}
        missing = required - set(raw) if isinstance(raw, dict) else required
        if missing:
            raise CheckpointError(f"{path}: a graft config needs {', '.join(sorted(missing))}")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})


def is_graft(path: str | Path | None) -> bool:
    """Whether `path` is a graft directory (`kvyard serve --model DIR` then serves its language model with images)."""
    return path is not None and (Path(path).expanduser() / CONFIG_FILE).is_file()
