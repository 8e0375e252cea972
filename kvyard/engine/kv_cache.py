"""Allocates the per-layer KV caches from a memory budget, dense or int8, and splits it between pools."""

from dataclasses import dataclass

import torch

from kvyard.errors import ConfigError, InvalidRequestError
from kvyard.models.config import ModelConfig
from kvyard.models.deepseek import mla_cache
from kvyard.models.kv_layer import LayerKV


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_dtype: str = "auto") -> int:
    if cfg.is_mla:  # one latent row per token and layer (kvyard/models/deepseek.py)
        if kv_dtype == "int8":
            raise ConfigError(f"kv_cache_dtype int8 is not implemented for {cfg.model_type}'s latent cache",
                              param="kv_cache_dtype")
        return cfg.num_layers * (cfg.kv_lora_rank + cfg.head_dim) * dtype.itemsize * block_size
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


@dataclass(frozen=True)
class KVGroups:
    """Which block table each layer's KV follows (kvyard/engine/window_blocks.py).

    Full attention only: one pool, nothing given back. Every layer sliding: one pool (`window`) whose blocks
    behind the window are given back. Mixed: the full layers' pool, plus a pool of the `sliding_layers`
    with their own tables (`sliding_window`)."""

    window: int | None = None
    sliding_window: int | None = None
    sliding_layers: frozenset[int] = frozenset()
    sinks: int = 0  # the first positions every sliding layer also sees: their blocks are never given back

    @classmethod
    def of(cls, cfg: ModelConfig) -> "KVGroups":
        windows = cfg.layer_windows
        slides = [w for w in windows if w is not None]
        if not slides:
            return cls()
        # Layers with a smaller window than their pool's read less of it (their own mask); the largest rules.
        sinks = cfg.sliding_window_sinks
        if len(slides) == len(windows):
            return cls(window=max(slides), sinks=sinks)
        return cls(sliding_window=max(slides),
                   sliding_layers=frozenset(i for i, w in enumerate(windows) if w is not None), sinks=sinks)


def pool_sizes(cfg: ModelConfig, groups: KVGroups, block_size: int, dtype: torch.dtype, budget_bytes: int,
               kv_dtype: str, max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, int]:
    """Blocks of the main pool and of the sliding layers' pool (0 without one) that the budget buys.

    The sliding pool needs no more than every running request's window plus one step's new tokens; the
    budget those layers would spend on longer contexts goes to the full layers instead."""
    n = num_blocks_for_budget(cfg, block_size, dtype, budget_bytes, kv_dtype)
    if groups.sliding_window is None:
        return n, 0
    # A window straddles one more block; the sink positions' blocks are kept too
    window_blocks = -(-(groups.sliding_window - 1) // block_size) + 2 + -(-groups.sinks // block_size)
    cap = max_num_seqs * window_blocks + -(-max_num_batched_tokens // block_size)
    if cap >= n:
        return n, n
    per_layer = bytes_per_block(cfg, block_size, dtype, kv_dtype) // cfg.num_layers
    sliding = len(groups.sliding_layers)
    full = (budget_bytes - sliding * cap * per_layer) // ((cfg.num_layers - sliding) * per_layer)
    return int(full), cap


def allocate_kv_caches(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
    kv_dtype: str = "auto", groups: KVGroups = KVGroups(), window_blocks: int = 0,
) -> list[LayerKV]:
    def blocks_of(layer: int) -> int:
        return window_blocks if layer in groups.sliding_layers else num_blocks

    if cfg.is_mla:
        return [mla_cache(num_blocks * block_size, cfg, dtype, device) for _ in range(cfg.num_layers)]
    return [
        LayerKV.allocate(blocks_of(i) * block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device, kv_dtype == "int8")
        for i in range(cfg.num_layers)
    ]
