"""Whole KV blocks out of and into a worker's per-layer caches, as raw copies (no dequantization).

A block is `block_size` consecutive slots, so viewing a slot tensor as [blocks, block_size, ...] turns a
transfer into one row gather (`np.take` on CPU, `index_select` elsewhere) or one `index_copy_` (scatter)
per tensor and layer. int8 caches move their values and scales as stored: the receiver gets bit-identical
KV, not a re-quantization.
"""

import numpy as np
import torch

from kvyard.models.kv_layer import LayerKV


def layer_tensors(cache: LayerKV) -> list[torch.Tensor]:
    """The tensors one layer stores: [k, v], or [k, v, k_scale, v_scale] for int8 KV."""
    if cache.k_scale is None or cache.v_scale is None:
        return [cache.k, cache.v]
    return [cache.k, cache.v, cache.k_scale, cache.v_scale]


def _per_block(t: torch.Tensor, block_size: int) -> torch.Tensor:
    return t.view(-1, block_size, *t.shape[1:])


def block_index(block_ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(block_ids, dtype=torch.long, device=device)


def _rows(t: torch.Tensor, block_size: int) -> np.ndarray:
    """A contiguous CPU tensor as a uint8 array with one row per block."""
    return t.view(torch.uint8).numpy().reshape(-1, block_size * t[0].nbytes)


def gather_layer(cache: LayerKV, index: torch.Tensor, block_size: int,
                 out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """One layer's blocks `index`, each tensor [len(index) * block_size, ...], contiguous.

    `out` (optional) are the destinations, e.g. views into a shared-memory segment, so the gather is the
    only copy.
    """
    result = []
    for i, t in enumerate(layer_tensors(cache)):
        dst = out[i] if out is not None else t.new_empty((len(index) * block_size, *t.shape[1:]))
        if t.device.type == "cpu":
            # numpy's take copies on the calling thread alone (GIL released). torch's index_select would start
            # an OpenMP team of its own on a transfer thread, next to the engine's: measured on the shared
            # 2-core VM, 12 ms against 0.04 ms per 768 KB tensor.
            np.take(_rows(t, block_size), index.numpy(), axis=0, out=_rows(dst, block_size), mode="clip")
        else:
            torch.index_select(_per_block(t, block_size), 0, index, out=_per_block(dst, block_size))
        result.append(dst)
    return result


def gather_blocks(caches: list[LayerKV], block_ids: list[int], block_size: int) -> list[list[torch.Tensor]]:
    """Per layer [k, v] or [k, v, k_scale, v_scale], each with leading dim len(block_ids) * block_size."""
    index = block_index(block_ids, caches[0].k.device)
    return [gather_layer(cache, index, block_size) for cache in caches]


def pack_blocks(tensors: list[list[torch.Tensor]], block_ids: list[int], block_size: int) -> torch.Tensor:
    """Blocks `block_ids` of per-layer tensors laid out block after block (a cache's, or a gather's) as one row
    of bytes each: [len(block_ids), block bytes] uint8 on the CPU, layer after layer and tensor after tensor
    within a row, as a tier of bytes stores a block (offload/codec.py).

    A row is then one buffer to checksum and write, where the per-layer form is 60 small ones for SmolLM2: on
    the 2-core VM the engine thread's copy fell from 0.34 to 0.12 ms a block, the writer's encode from 0.30 to
    0.09 ms.
    """
    flat = [t for layer in tensors for t in layer]
    widths = [block_size * t[0].nbytes for t in flat]
    out = torch.empty((len(block_ids), sum(widths)), dtype=torch.uint8)
    rows, offset, index = out.numpy(), 0, np.asarray(block_ids, dtype=np.int64)
    for t, width in zip(flat, widths, strict=True):
        src, at = t, index
        if t.device.type != "cpu":  # gather on the device, then bring only those blocks over
            picked = torch.index_select(_per_block(t, block_size), 0, block_index(block_ids, t.device))
            src, at = picked.cpu().reshape(-1, *t.shape[1:]), np.arange(len(block_ids))
        np.take(_rows(src, block_size), at, axis=0, out=rows[:, offset : offset + width], mode="clip")
        offset += width
    return out


def scatter_blocks(caches: list[LayerKV], block_ids: list[int], block_size: int,
                   tensors: list[list[torch.Tensor]]) -> None:
    """Write `tensors` (as gather_blocks returns them) into blocks `block_ids` of `caches`."""
    if len(tensors) != len(caches):
        raise ValueError(f"{len(tensors)} layers of KV for {len(caches)} cache layers")
    index = block_index(block_ids, caches[0].k.device)
    for cache, layer in zip(caches, tensors, strict=True):
        dst = layer_tensors(cache)
        if len(layer) != len(dst):
            raise ValueError(f"{len(layer)} tensors per layer for a cache that stores {len(dst)}")
        for t, src in zip(dst, layer, strict=True):
            scatter_tensor(t, index, block_size, src.to(t.device))


def scatter_tensor(t: torch.Tensor, index: torch.Tensor, block_size: int, src: torch.Tensor) -> None:
    """Rows of `src`, block after block, into blocks `index` of cache tensor `t`."""
    if src.dtype != t.dtype or src.shape[1:] != t.shape[1:]:
        raise ValueError(f"cannot scatter {src.dtype} {tuple(src.shape)} into {t.dtype} {tuple(t.shape)}")
    if t.device.type == "cpu":
        # numpy, for the reason the gather uses it: torch's index_copy_ took 476 ms against 7 ms for numpy
        # for 46 MB of SmolLM2 KV (125 blocks) on the shared 2-core VM, on the engine thread.
        _rows(t, block_size)[index.numpy()] = _rows(src.contiguous(), block_size)
    else:
        _per_block(t, block_size).index_copy_(0, index, _per_block(src, block_size))
