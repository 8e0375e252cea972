"""A KV block as bytes, for the tiers that store bytes (disk files, Redis values).

Layout: a header (magic, token count, CRC-32 and length of the body), then the body: the block's tokens as
int64 and its tensors' bytes as the cache stores them, layer after layer. Decoding checks all of it, so a
truncated or corrupt entry, or one holding other tokens, reads as nothing rather than as wrong KV.
"""

import struct
import zlib

import numpy as np
import torch

MAGIC = b"KVYD1"
_HEADER = struct.Struct("<5sIIQ")  # magic, tokens, crc32(body), len(body)

# Per layer, per stored tensor: the shape and dtype of one block of it.
BlockLayout = list[list[tuple[tuple[int, ...], torch.dtype]]]


def encode_parts(tokens: tuple[int, ...], tensors: list[list[torch.Tensor]]) -> list[bytes | memoryview]:
    """The block's bytes as buffers to write one after another (os.writev): the tensors' memory itself, not a
    copy, with the CRC-32 computed over it in place."""
    parts: list[bytes | memoryview] = [np.asarray(tokens, dtype=np.int64).tobytes()]
    parts += [memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy()) for layer in tensors for t in layer]
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return [_HEADER.pack(MAGIC, len(tokens), crc, sum(len(part) for part in parts)), *parts]


def encode_block(tokens: tuple[int, ...], tensors: list[list[torch.Tensor]]) -> bytes:
    return b"".join(encode_parts(tokens, tensors))


def decode_block(data: bytes, tokens: tuple[int, ...], layout: BlockLayout) -> list[list[torch.Tensor]] | None:
    """The block's tensors, or None when `data` is damaged or holds other tokens."""
    if len(data) < _HEADER.size:
        return None
    magic, n, crc, length = _HEADER.unpack_from(data)
    body = data[_HEADER.size :]
    if magic != MAGIC or len(body) != length or zlib.crc32(body) != crc or n != len(tokens):
        return None
    if tuple(np.frombuffer(body, dtype=np.int64, count=n).tolist()) != tokens:
        return None
    offset, out = 8 * n, []
    buf = torch.frombuffer(bytearray(body), dtype=torch.uint8)  # one writable copy; the tensors are views of it
    kinds = {kind for layer in layout for kind in layer}
    if len(kinds) == 1 and len({len(layer) for layer in layout}) == 1:  # the usual layout: one view, then unbind
        ((shape, dtype),) = kinds
        per_layer = len(layout[0])
        if len(body) - offset != len(layout) * per_layer * int(np.prod(shape)) * dtype.itemsize:
            return None
        grid = buf[offset:].view(dtype).view(len(layout), per_layer, *shape)
        return [list(layer.unbind(0)) for layer in grid.unbind(0)]
    for layer in layout:
        tensors = []
        for shape, dtype in layer:
            size = int(np.prod(shape)) * dtype.itemsize
            if offset + size > len(body):
                return None
            tensors.append(buf[offset : offset + size].view(dtype).view(shape))
            offset += size
        out.append(tensors)
    return out if offset == len(body) else None
