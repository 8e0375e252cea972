"""One view of a checkpoint, whatever its on-disk format: config, tokenizer and named tensors."""

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvyard.errors import CheckpointError
from kvyard.models.config import ModelConfig
from kvyard.quant.qtensor import QuantizedTensor

TensorStream = Callable[[], Iterator[tuple[str, torch.Tensor | QuantizedTensor]]]


@dataclass
class Checkpoint:
    path: Path
    hf_config: dict[str, Any]  # shaped like an HF config.json, whatever the source format
    config: ModelConfig
    tokenizer: Any  # a transformers PreTrainedTokenizerFast
    # Yields (HF parameter name, tensor) lazily so that only one tensor is dequantized at a time;
    # a quantized checkpoint yields its low-bit layers as QuantizedTensor.
    tensors: TensorStream
    # GGUF only: the same stream with the linear layers whose blocks kvyard's kernels run as they are (Q4_0,
    # Q4_1, Q4_K, Q5_0, Q5_1, Q8_0) kept as QuantizedTensors (`--quantization gguf`; loader/gguf_native.py),
    # and how many.
    native_tensors: TensorStream | None = None
    native_layers: int = 0
    # SamplingParams fields the model's authors recommend (loader/generation_defaults.py); may be empty.
    generation_defaults: dict[str, float | int] = field(default_factory=dict)


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Open an HF checkpoint directory or a GGUF file."""
    from kvyard.loader.gguf_file import load_gguf
    from kvyard.loader.hf_dir import load_hf_dir

    p = Path(path)
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if not (p / "config.json").exists() and len(ggufs) == 1:
            return load_gguf(ggufs[0])
        return load_hf_dir(p)
    if p.suffix == ".gguf" and p.is_file():
        return load_gguf(p)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    raise CheckpointError(f"{p}: not a checkpoint (expected an HF directory with config.json, or a .gguf file)")
