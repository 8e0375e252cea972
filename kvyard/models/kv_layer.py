"""One layer's paged KV cache: flat slots of K and V, dense or int8 with a scale per token and head.

int8 halves the cache's bytes (twice the tokens in the same budget); each written token/head row is
scaled by its own absolute maximum, so one outlier token never coarsens the others. Reads dequantize
the gathered slots to the compute dtype just before attention.
"""

from dataclasses import dataclass

import torch


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, heads, dim] -> int8 values and a float32 scale per [tokens, heads]."""
    xf = x.float()
    scale = xf.abs().amax(-1).div_(127.0)
    scale.masked_fill_(scale == 0, 1.0)  # an all-zero row: any scale reads it back as zeros
    q = (xf / scale.unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale


@dataclass
class LayerKV:
    k: torch.Tensor  # [slots, kv_heads, head_dim], the model dtype or int8
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [slots, kv_heads] float32 when int8
    v_scale: torch.Tensor | None = None
    # The model's qk_scale when its keys are smoothed (kvyard/quant/kv_smoothing.py): K is stored divided by
    # its key rows, so a worker may only read blocks written under the same factors (disagg/layout.py).
    key_smoothing: torch.Tensor | None = None

    @classmethod
    def allocate(cls, slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 int8: bool = False) -> "LayerKV":
        def zeros(*shape: int, dt: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dt, device=device)

        if not int8:
            return cls(zeros(slots, kv_heads, head_dim, dt=dtype), zeros(slots, kv_heads, head_dim, dt=dtype))
        return cls(
            zeros(slots, kv_heads, head_dim, dt=torch.int8), zeros(slots, kv_heads, head_dim, dt=torch.int8),
            zeros(slots, kv_heads, dt=torch.float32), zeros(slots, kv_heads, dt=torch.float32),
        )

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if not self.quantized:
            self.k.index_copy_(0, slots, k)
            self.v.index_copy_(0, slots, v)
            return
        # K and V quantized in one go: the per-row ops are the same, and a layer's op count adds up.
        heads = k.shape[1]
        q, s = quantize_rows(torch.cat([k, v], dim=1))
        self.k.index_copy_(0, slots, q[:, :heads])
        self.v.index_copy_(0, slots, q[:, heads:])
        self.k_scale.index_copy_(0, slots, s[:, :heads])  # type: ignore[union-attr]
        self.v_scale.index_copy_(0, slots, s[:, heads:])  # type: ignore[union-attr]

    def _dequant(self, q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return q.to(torch.float32).mul_(s.unsqueeze(-1)).to(dtype)

    def read_slots(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given slots, [len(slots), kv_heads, head_dim] in `dtype`."""
        k, v = self.k.index_select(0, slots), self.v.index_select(0, slots)
        if not self.quantized:
            return k, v
        return (self._dequant(k, self.k_scale.index_select(0, slots), dtype),  # type: ignore[union-attr]
                self._dequant(v, self.v_scale.index_select(0, slots), dtype))  # type: ignore[union-attr]

    def read_blocks(self, blocks: torch.Tensor, block_size: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole blocks (fewer, larger copies than slot by slot): [len(blocks) * block_size, kv_heads, head_dim]."""
        heads = self.k.shape[1]

        def gather(t: torch.Tensor) -> torch.Tensor:
            per_block = t.view(-1, block_size * heads, *t.shape[2:])  # scales have no head_dim axis
            return per_block.index_select(0, blocks).view(-1, heads, *t.shape[2:])

        k, v = gather(self.k), gather(self.v)
        if not self.quantized:
            return k, v
        return (self._dequant(k, gather(self.k_scale), dtype),  # type: ignore[arg-type]
                self._dequant(v, gather(self.v_scale), dtype))  # type: ignore[arg-type]
