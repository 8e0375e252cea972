"""Allocates the per-layer K and V tensors from a memory budget."""

import torch

from kvyard.errors import InvalidRequestError
from kvyard.models.config import ModelConfig


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    return per_token * block_size


def num_blocks_for_budget(cfg: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    n = budget_bytes // bytes_per_block(cfg, block_size, dtype)
    if n < 1:
        raise InvalidRequestError(
            f"kv_cache_memory={budget_bytes} bytes holds no block of {block_size} tokens "
            f"({bytes_per_block(cfg, block_size, dtype)} bytes each)",
            param="kv_cache_memory",
        )
    return int(n)


def allocate_kv_caches(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(cfg.num_layers)
    ]
