"""HF's view of a retrofitted model with attention sinks (`kvyard retrofit --attention swa --sinks S`).

HF's qwen2 builds sliding-window masks without sinks, and its config has no key for them, so the retrofit's
own comparisons and its distillation run HF through `SinkMasks`: the masks are built here, one per layer type
(HF takes such a mapping in place of a 2-D attention mask), with the sliding layers' keys within the window or
among the first `sinks` positions, as kvyard's engine runs them (`kvyard.models.attention.position_mask`).
"""

from typing import Any

import torch

from kvyard.models.attention import position_mask


class SinkMasks(torch.nn.Module):
    def __init__(self, model: Any, window: int, sinks: int):
        super().__init__()
        self.model, self.window, self.sinks = model, window, sinks

    @property
    def config(self) -> Any:
        return self.model.config

    def masks(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Additive [batch, 1, queries, keys] masks for the full and the sliding layers; padding keys are hidden
        (a padding query sees itself, so that no row is empty)."""
        batch, n = input_ids.shape
        pos = torch.arange(n, device=input_ids.device)
        valid = attention_mask.bool() if attention_mask is not None else torch.ones(batch, n, dtype=torch.bool)
        diagonal = torch.eye(n, dtype=torch.bool, device=input_ids.device)
        dtype = self.model.dtype

        def additive(allowed: torch.Tensor) -> torch.Tensor:
            allowed = (allowed.unsqueeze(0) & valid.unsqueeze(1)) | diagonal
            return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf")).unsqueeze(1)

        return {"full_attention": additive(position_mask(pos, pos)),
                "sliding_attention": additive(position_mask(pos, pos, self.window, self.sinks))}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        return self.model(input_ids=input_ids, attention_mask=self.masks(input_ids, attention_mask), **kwargs)

    def save_pretrained(self, directory: str) -> None:
        self.model.save_pretrained(directory)
