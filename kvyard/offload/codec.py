"""A KV block as bytes, for the tiers that store bytes (disk files, Redis values).

Layout: a header (magic, token count, xxh3-64 and length of the body), then the body: the block's tokens as
int64 and its tensors' bytes as the cache stores them, layer after layer. Decoding checks all of it, so a
truncated or corrupt entry, or one holding other tokens, reads as nothing rather than as wrong KV.

The checksum is xxh3-64, as on the KV wire (disagg/wire.py): zlib's CRC-32 took 0.086 ms of a 368 KB SmolLM2
block on the 2-core VM, a quarter of the disk writer's time per block, xxh3 0.006 ms. Entries of the CRC-32
format (magic KVYD1) read as damaged: a miss, recomputed, then rewritten.
"""

import struct

import numpy as np
import torch
import xxhash

MAGIC = b"KVYD2"
_HEADER = struct.Struct("<5sIQQ")  # magic, tokens, xxh3-64(body), len(body)

# Per layer, per stored tensor: the shape and dtype of one block of it.
BlockLayout = list[list[tuple[tuple[int, ...], torch.dtype]]]


def encode_parts(tokens: tuple[int, ...], block: torch.Tensor) -> list[bytes | memoryview]:
    """The block's bytes as buffers to write one after another (os.writev): the header, the tokens, and the
    packed block's memory itself (uint8, as disagg.blocks.pack_blocks lays out a row), not a copy, its checksum computed in place."""
    parts: list[bytes | memoryview] = [np.asarray(tokens, dtype=np.int64).tobytes(),
                                       memoryview(block.contiguous().numpy())]
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part)
    return [_HEADER.pack(MAGIC, len(tokens), digest.intdigest(), sum(len(part) for part in parts)), *parts]


HEADER_SIZE = _HEADER.size


def encoded_length(header: bytes) -> int | None:
    """From an entry's first HEADER_SIZE bytes, the length of the whole entry; None if they are not a header."""
    if len(header) < HEADER_SIZE:
        return None
    magic, _, _, length = _HEADER.unpack_from(header)
    return HEADER_SIZE + length if magic == MAGIC else None


def encode_block(tokens: tuple[int, ...], block: torch.Tensor) -> bytes:
    return b"".join(encode_parts(tokens, block))


def decode_block(data: bytes, tokens: tuple[int, ...], layout: BlockLayout) -> list[list[torch.Tensor]] | None:
    """The block's tensors, or None when `data` is damaged or holds other tokens."""
    if len(data) < _HEADER.size:
        return None
    magic, n, checksum, length = _HEADER.unpack_from(data)
    body = data[_HEADER.size :]
    if magic != MAGIC or len(body) != length or xxhash.xxh3_64_intdigest(body) != checksum or n != len(tokens):
        return None
    if tuple(np.frombuffer(body, dtype=np.int64, count=n).tolist()) != tokens:
        return None
    # one writable copy; the tensors are views of it
    return unpack_block(torch.frombuffer(bytearray(body), dtype=torch.uint8)[8 * n :], layout)


def unpack_block(row: torch.Tensor, layout: BlockLayout) -> list[list[torch.Tensor]] | None:
    """A block's tensors as views of its packed bytes (uint8, as disagg.blocks.pack_blocks lays out a row);
    None when the row is not the layout's size."""
    kinds = {kind for layer in layout for kind in layer}
    if len(kinds) == 1 and len({len(layer) for layer in layout}) == 1:  # the usual layout: one view, then unbind
        ((shape, dtype),) = kinds
        per_layer = len(layout[0])
        if len(row) != len(layout) * per_layer * int(np.prod(shape)) * dtype.itemsize:
            return None
        grid = row.view(dtype).view(len(layout), per_layer, *shape)
        return [list(layer.unbind(0)) for layer in grid.unbind(0)]
    offset, out = 0, []
    for layer in layout:
        tensors = []
        for shape, dtype in layer:
            size = int(np.prod(shape)) * dtype.itemsize
            if offset + size > len(row):
                return None
            tensors.append(row[offset : offset + size].view(dtype).view(shape))
            offset += size
        out.append(tensors)
    return out if offset == len(row) else None
