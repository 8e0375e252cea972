"""The KV transfer protocol's messages and frame helpers, shared by source and fetcher.

One fetch, over a DEALER (fetcher) → ROUTER (source) connection, all control messages msgpack:

    fetcher: Fetch(transfer_id, layout, host_id, shm, lease_s, shm_checksums)
    source:  Refused(reason)                                   unknown id, layout mismatch, ...
          or [Header(mode="blocks", sums), frame, frame, ...]  every tensor of every layer in one message
          or Header(mode="layers"), then per layer [LayerHeader(index, sums), frame, ...]
          or Header(mode="shm", shm_name), then per layer LayerHeader(index, sums)  frames in a shared-memory
                                                               segment, each layer announced once written
    fetcher: Release(transfer_id, ok, reason, confirm)         after validating (or rejecting) the payload,
                                                               or, read in place, after using it
    source:  Released(found)                                   unless confirm is False

A frame is one tensor's raw bytes (per layer k, v[, k_scale, v_scale]); its size follows from the layout
and the block count, and its checksum travels in the header (or its layer's header), so the fetcher checks
both before it returns. In a segment or a staging buffer the frames lie at `frame_offsets`.

The checksum is xxh3-64, not zlib's crc32: crc32 ran at 1-2.5 GB/s on this 2-core VM, one pass on each
side, which was over half of a TCP transfer of 46 MB of SmolLM2 KV (blocks mode 131 -> 68 ms without it);
xxh3 measured 13 GB/s here. `kvyard bench kv-transfer` reports its speed.
"""

import os
import socket
from functools import cache

import msgspec
import torch
import xxhash

from kvyard.disagg.layout import KVLayout, numel

SHM_ALIGN = 64  # frame offsets in a staging buffer or segment: every dtype's view stays aligned


class Fetch(msgspec.Struct, tag="fetch"):
    transfer_id: str
    layout: KVLayout  # the fetcher's own: the source refuses a mismatch before sending any data
    host_id: str = ""  # empty: no shared memory possible
    shm: bool = False  # the fetcher accepts a shared-memory reply
    lease_s: float = 0.0  # how long the fetcher may take to copy a shared-memory segment out
    # False: a shared-memory reply carries no checksums (empty lists). Only for a fetcher that reads the
    # segment in place within its lease: the bytes never leave this host's memory, the lease keeps the
    # segment from reuse, and a checksum pass on each side cost a third of the transfer's time here.
    shm_checksums: bool = True


class Release(msgspec.Struct, tag="release"):
    transfer_id: str
    ok: bool = True  # False: the fetcher rejected the payload; `reason` says why
    reason: str = ""
    confirm: bool = True  # False: the fetcher has closed its socket, send no Released back


class Header(msgspec.Struct, tag="header"):
    transfer_id: str
    mode: str  # "blocks", "layers" or "shm"
    layout: KVLayout
    block_hashes: list[bytes]
    token_ids: list[int]
    frame_nbytes: list[int]  # every frame of every layer, in order
    frame_checksum: list[int]  # xxh3-64 of each frame; empty in "layers" and "shm" modes (in each LayerHeader)
    # and in a LayerHeader of an "shm" reply to a Fetch without shm_checksums
    shm_name: str = ""


class LayerHeader(msgspec.Struct, tag="layer"):
    index: int
    frame_checksum: list[int]


class Refused(msgspec.Struct, tag="refused"):
    reason: str
    integrity: bool = False  # True: the payload could never be valid (layout); False: cannot be served


class Released(msgspec.Struct, tag="released"):
    found: bool


encode = msgspec.msgpack.Encoder().encode
decode_request = msgspec.msgpack.Decoder(Fetch | Release).decode
decode_reply = msgspec.msgpack.Decoder(Header | Refused).decode
decode_layer = msgspec.msgpack.Decoder(LayerHeader).decode
decode_released = msgspec.msgpack.Decoder(Released | Refused).decode


def as_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy (bf16 has no buffer format: go through uint8)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def checksum(buf: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(buf)


def frame_views(buf: torch.Tensor, layout: KVLayout, num_blocks: int) -> list[list[torch.Tensor]]:
    """Per layer, typed tensors over the uint8 tensor `buf` where that layer's frames go (frame_offsets)."""
    specs = layout.frame_specs(num_blocks)
    offsets, _ = frame_offsets(layout.wire_nbytes(num_blocks))
    views = [buf[off : off + dtype.itemsize * numel(shape)].view(dtype).view(shape)
             for off, (dtype, shape) in zip(offsets, specs * layout.num_layers, strict=True)]
    return [views[i : i + len(specs)] for i in range(0, len(views), len(specs))]


def frame_offsets(nbytes: list[int]) -> tuple[list[int], int]:
    """Aligned offsets of the frames in one buffer, and the buffer's size."""
    offsets, end = [], 0
    for n in nbytes:
        offsets.append(end)
        end += -(-n // SHM_ALIGN) * SHM_ALIGN
    return offsets, end


@cache
def host_id() -> str:
    """Same value on two processes iff they share a host (and boot); "" when unknown (no shared memory).

    A replica placed by Ray names its Ray node instead (`KVYARD_NODE_ID`, kvyard/cluster/replica.py): the
    node id, not a guess from addresses, decides whether a pull may use shared memory."""
    node = os.environ.get("KVYARD_NODE_ID")
    if node:
        return f"ray-node/{node}" if os.path.isdir("/dev/shm") else ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return ""
    return f"{socket.gethostname()}/{boot}" if boot and os.path.isdir("/dev/shm") else ""


def advertised(endpoint: str, host: str | None) -> str:
    """The bound endpoint with the host a fetcher should dial (a wildcard bind needs `advertise_host`)."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    bound, _, port = endpoint[len("tcp://"):].rpartition(":")
    if host is None and bound in ("0.0.0.0", "*", "[::]"):
        host = socket.gethostname()
    return f"tcp://{host or bound}:{port}"
