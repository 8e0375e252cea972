"""The decoder class for a checkpoint's family: DecoderModel for the llama family, a subclass where one differs."""

import torch

from kvyard.models.config import ModelConfig
from kvyard.models.decoder import DecoderModel
from kvyard.models.deepseek import DeepSeekModel
from kvyard.models.gemma3 import Gemma3Model

MODEL_CLASSES: dict[str, type[DecoderModel]] = {
    "gemma3_text": Gemma3Model, "deepseek_v2": DeepSeekModel, "deepseek_v3": DeepSeekModel}


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
                max_rows: int | None = None) -> DecoderModel:
    """An empty model of `cfg`'s family, to `load` weights into."""
    return MODEL_CLASSES.get(cfg.model_type, DecoderModel)(cfg, dtype, device, max_positions, max_rows)
