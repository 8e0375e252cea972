"""The KV transfer interfaces between a prefill worker and a decode worker.

A prefill worker computes a prompt's KV and `offer`s its blocks under a transfer id; the engine keeps
those blocks referenced until the source calls `on_release` (after the decode side acknowledged, or a
timeout). A decode worker `fetch`es the transfer by id from the source's `endpoint`, gets a fully
validated `KVPayload` (or KVTransferError / KVIntegrityError), scatters it into its own blocks
(`blocks.scatter_blocks`) and continues decoding. `zmq_transport` implements both sides over ZeroMQ (TCP,
or shared memory on one host).

Other data planes (NIXL, Mooncake) plug in at this boundary and keep everything else: the control
messages (offer/hold/release/timeout, the header with layout, block hashes, token ids) stay as they are;
only the frames change. Such a source registers each layer's slot tensors with the engine once at start
(they never move), and instead of data frames its reply carries its agent metadata plus one descriptor
per (layer, tensor, block): (address = base + block_id * block_bytes, length, device). The fetcher
registers its destination (a receive buffer, or directly its own cache blocks, which saves the scatter),
issues one READ over the descriptor list, waits for completion within its timeout, checks what it read
(layout, hashes, sizes; a checksum would need a pass over the data, which RDMA's link CRC makes optional)
and then sends `Release`, exactly as here. Block ids are stable while held, so descriptors are valid until
`on_release`.

What installs here (x86_64, CPython 3.11, CPU-only torch, no CUDA, no RDMA NIC), checked with
`pip download --no-deps` outside the project's dependencies:
- `nixl` 1.5.2 is an 11 kB meta package requiring `nixl-cu12==1.5.2` and `nixl-cu13==1.5.2`; the index has
  nixl-cu12 only up to 1.5.1, so `pip install nixl` does not resolve. The `nixl-cu12` 1.5.1 wheel (69 MB)
  imports without CUDA, lists the UCX, POSIX, GDS, LIBFABRIC, OBJ, ... plugins, and a DRAM-to-DRAM READ
  between two agents in one process (UCX backend) returned the right bytes at about 0.7 GB/s for 64 MiB
  on this shared 2-core VM. So NIXL could serve as a CPU data plane here; it was not tried across
  processes and is not a dependency.
- `mooncake-transfer-engine` 0.3.13.post1 (98 MB wheel) downloads, but `mooncake.engine` fails to import:
  libcudart.so.12 is missing, and the engine also links libcuda.so.1, libibverbs.so.1 and libmlx5.so.1.
"""

from collections.abc import Callable
from typing import Protocol

from kvyard.disagg.layout import KVLayout
from kvyard.disagg.payload import KVPayload


class KVSourceProtocol(Protocol):
    """The prefill side: holds offered blocks until released, serves them to fetchers."""

    endpoint: str  # what a decode worker passes to `fetch`

    def offer(self, transfer_id: str, block_ids: list[int], block_hashes: list[bytes], token_ids: list[int],
              on_release: Callable[[], None], timeout_s: float) -> None:
        """Thread-safe. Call `on_release` exactly once: after the ack, after `timeout_s`, or on close."""
        ...

    def close(self) -> None: ...


class KVFetcherProtocol(Protocol):
    """The decode side: pulls one transfer, validates all of it, then lets the source release it."""

    def fetch(self, endpoint: str, transfer_id: str, layout: KVLayout, expected_hashes: list[bytes],
              timeout_s: float, in_place: bool = False) -> KVPayload:
        """Raises KVTransferError (cannot get it) or KVIntegrityError (got something unusable).

        `in_place`: the payload may stay in the transport's memory (readable until `valid_until`) and is
        acknowledged when the caller calls `payload.finish()`; otherwise it is the caller's, acknowledged."""
        ...

    def close(self) -> None: ...
