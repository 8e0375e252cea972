"""Allocates the per-layer KV caches from a memory budget, dense or int8."""

import torch

from kvyard.errors import InvalidRequestError
from kvyard.models.config import ModelConfig
from kvyard.models.kv_layer import LayerKV


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_dtype: str = "auto") -> int:
    if kv_dtype == "int8":
        per_head = cfg.head_dim + 4  # int8 values and one float32 scale per token and head
    else:
        per_head = cfg.head_dim * dtype.itemsize
    return 2 * cfg.num_layers * cfg.num_kv_heads * per_head * block_size


def num_blocks_for_budget(cfg: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int,
                          kv_dtype: str = "auto") -> int:
    per_block = bytes_per_block(cfg, block_size, dtype, kv_dtype)
    n = budget_bytes // per_block
    if n < 1:
        raise InvalidRequestError(
            f"kv_cache_memory={budget_bytes} bytes holds no block of {block_size} tokens ({per_block} bytes each)",
            param="kv_cache_memory",
        )
    return int(n)


def allocate_kv_caches(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
    kv_dtype: str = "auto",
) -> list[LayerKV]:
    return [
        LayerKV.allocate(num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device, kv_dtype == "int8")
        for _ in range(cfg.num_layers)
    ]
