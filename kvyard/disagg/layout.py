"""What one block of KV looks like on a worker, so that two workers can agree before moving bytes.

A decode worker may only use KV computed by a prefill worker whose cache stores the same thing: same
layer count, heads, head size, block size, storage dtype (int8 KV also carries float32 scales) and key
smoothing. The layout travels with every fetch request and every payload; `mismatches` names each
difference.
"""

import hashlib

import msgspec
import torch

from kvyard.models.kv_layer import LayerKV

SCALE_DTYPE = torch.float32  # int8 KV: one scale per (token, head), see LayerKV


class KVLayout(msgspec.Struct, frozen=True):
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # torch dtype name of K/V storage: "bfloat16", "float32", "int8", ...
    quantized: bool  # int8 K/V with a float32 scale per (token, head): k_scale, v_scale
    key_smoothing: str = ""  # digest of the factors K is stored divided by ("" when none; LayerKV)

    @classmethod
    def of(cls, caches: list[LayerKV], block_size: int) -> "KVLayout":
        k = caches[0].k
        return cls(num_layers=len(caches), num_kv_heads=k.shape[1], head_dim=k.shape[2], block_size=block_size,
                   dtype=str(k.dtype).removeprefix("torch."), quantized=caches[0].quantized,
                   key_smoothing=smoothing_digest(caches))

    @property
    def torch_dtype(self) -> torch.dtype:
        dt = getattr(torch, self.dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"unknown torch dtype {self.dtype!r}")
        return dt

    def frame_specs(self, num_blocks: int) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """Dtype and shape of each tensor of one layer for `num_blocks` blocks: k, v[, k_scale, v_scale]."""
        slots = num_blocks * self.block_size
        kv = (self.torch_dtype, (slots, self.num_kv_heads, self.head_dim))
        if not self.quantized:
            return [kv, kv]
        scale = (SCALE_DTYPE, (slots, self.num_kv_heads))
        return [kv, kv, scale, scale]

    def frame_nbytes(self, num_blocks: int) -> list[int]:
        """Bytes of each tensor of one layer (the same for every layer)."""
        return [dt.itemsize * numel(shape) for dt, shape in self.frame_specs(num_blocks)]

    def wire_nbytes(self, num_blocks: int) -> list[int]:
        """Bytes of every tensor of every layer, in the order they travel: layer 0's k, v, ..., layer 1's ..."""
        return self.frame_nbytes(num_blocks) * self.num_layers

    def block_nbytes(self) -> int:
        return self.num_layers * sum(self.frame_nbytes(1))

    def mismatches(self, other: "KVLayout") -> list[str]:
        """Each field that differs, as 'field: expected <self>, got <other>'; [] when the layouts are equal."""
        return [f"{name}: expected {getattr(self, name)!r}, got {getattr(other, name)!r}"
                for name in self.__struct_fields__ if getattr(self, name) != getattr(other, name)]


def smoothing_digest(caches: list[LayerKV]) -> str:
    """Which key smoothing the caches' K was written under: two workers fit it on their own, and a factor
    rounded the other way on different hardware would silently misread one channel pair."""
    factors = [c.key_smoothing for c in caches]
    if all(f is None for f in factors):
        return ""
    h = hashlib.sha256()
    for f in factors:
        h.update(b"-" if f is None else f.float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
