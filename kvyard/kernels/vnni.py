"""The weight layout kvyard's AMX kernels read (csrc/amx.h): VNNI blocks of 32 output columns.

[N, K] -> [N/32, K/2, 32, 2]: for each block of 32 output columns, row p holds the pair W[n, 2p],
W[n, 2p + 1] of each column n in turn, the order TDPBF16PS reads. The bf16 and the low-bit kernels share it.
"""

import torch

BLOCK_COLS = 32  # output columns per block: two 16-column AMX B tiles
TILE_K = 32  # input values per AMX tile row


def fits(n: int, k: int) -> bool:
    return n % BLOCK_COLS == 0 and k % TILE_K == 0


def to_blocks(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/32, K/2, 32, 2], contiguous."""
    n, k = w.shape
    return w.reshape(n // BLOCK_COLS, BLOCK_COLS, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def from_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """[N/32, K/2, 32, 2] -> [N, K]."""
    nb, pairs = blocks.shape[:2]
    return blocks.permute(0, 2, 1, 3).reshape(nb * BLOCK_COLS, pairs * 2)
