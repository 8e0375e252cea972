"""The decode side of KV transfer over ZeroMQ: `KVFetcher` pulls one transfer and validates all of it.

Nothing is returned until every check passed: the header's layout and block hashes against this
worker's, each frame's size and checksum, the frame count, then `check_payload` on the typed tensors. Only
then does the fetcher tell the source to release; a payload it rejects is released too (with the reason),
since a retry would get the same bytes. Every wait is bounded by the fetch's timeout, and a socket monitor
turns a source that drops the connection mid-transfer into an immediate KVTransferError.

Each fetch opens its own DEALER socket, so one KVFetcher serves any number of threads. A "blocks" reply's
frames are wrapped as tensors without a copy; "layers" and shared-memory replies are copied layer by layer
into warm memory as they arrive (`receive.py` says why), the segment before the ack since the source
reuses it after. If the segment cannot be opened (another /dev/shm namespace), the fetch retries over TCP.

`fetch(..., in_place=True)` leaves a shared-memory reply where it is: the payload's tensors are read-only
views of the source's segment, and the ack waits for `payload.finish()`. The source keeps the segment
for the fetch's lease (its timeout, counted from before the request), so the views hold what the source
wrote until `payload.valid_until`; a caller that finishes with them later must treat what it read as
lost. Such a reply is checked for layout, hashes and sizes but not checksummed (wire.Fetch says why).
"""

import logging
import math
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvyard.cluster.auth import present_token
from kvyard.disagg import shm, wire
from kvyard.disagg.layout import KVLayout
from kvyard.disagg.payload import KVIntegrityError, KVPayload, KVTransferError, check_hashes, check_payload
from kvyard.disagg.receive import LayerCopier, frame_tensor
from kvyard.disagg.warm_buffers import WarmBuffers

log = logging.getLogger(__name__)

TENSOR_NAMES = ("k", "v", "k_scale", "v_scale")
# A source that asks for a cluster token refuses a wrong one (AUTH) or none at all (PROTOCOL, or NO_DETAIL, as
# libzmq reports another mechanism on some sockets).
_REFUSALS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
             | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
T = TypeVar("T")


class _Connection:
    """One DEALER socket to a source, with a deadline and a disconnect monitor."""

    def __init__(self, ctx: zmq.Context, endpoint: str, timeout_s: float, token: str | None = None):
        self.endpoint, self.timeout_s = endpoint, timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)  # never block on close: a dead source must not hang us
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | _REFUSALS)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.disconnected = False
        self.refused = False  # the source refused our cluster token (or its absence)
        present_token(self.sock, token)
        self.sock.connect(endpoint)

    def send(self, msg: msgspec.Struct) -> None:
        try:
            self.sock.send(wire.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise KVTransferError(f"{self.endpoint}: cannot send to the KV source: {e}") from e

    def recv(self, what: str, deadline: float | None = None) -> list[zmq.Frame]:
        deadline = self.deadline if deadline is None else deadline
        while True:
            if self.sock.poll(0):
                return self.sock.recv_multipart(copy=False)
            if self.refused:
                raise KVTransferError(f"{self.endpoint}: the KV source refused this worker's cluster token "
                                      "(workers of one deployment share $KVYARD_CLUSTER_TOKEN)")
            if self.disconnected:  # every message that arrived whole was read above
                raise KVTransferError(f"{self.endpoint}: the KV source disconnected while waiting for {what}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise KVTransferError(f"{self.endpoint}: timed out after {self.timeout_s:g} s waiting for {what} "
                                      "(KV source unreachable, dead or stalled)")
            if self.monitor in dict(self.poller.poll(math.ceil(1000 * left))):
                while self.monitor.poll(0):  # all of them: a refusal comes with a disconnect
                    event = recv_monitor_message(self.monitor)["event"]
                    self.disconnected |= event == zmq.EVENT_DISCONNECTED
                    self.refused |= bool(event & _REFUSALS)

    def close(self, linger_ms: int = 0) -> None:
        """`linger_ms`: how long ZeroMQ may still deliver what was sent last (close itself never blocks)."""
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=linger_ms)


class KVFetcher:
    def __init__(self, *, allow_shm: bool = True, release_wait_s: float = 1.0, token: str | None = None):
        """`release_wait_s`: how long a fetch waits for the source to confirm the release (beyond its timeout).
        `token`: the fleet's cluster token, presented to sources that ask for it."""
        self.token = token
        self.allow_shm = allow_shm and bool(wire.host_id())
        self.release_wait_s = release_wait_s
        self.buffers = WarmBuffers()  # where layers and shared-memory segments are copied to
        self._ctx = zmq.Context()

    def fetch(self, endpoint: str, transfer_id: str, layout: KVLayout, expected_hashes: list[bytes],
              timeout_s: float, in_place: bool = False) -> KVPayload:
        """Pull transfer `transfer_id` from the source at `endpoint`, validated; then release it there, or,
        for a payload left in place, when the caller calls `payload.finish()`."""
        conn = _Connection(self._ctx, endpoint, timeout_s, self.token)
        deferred = False
        try:
            payload = self._pull(conn, transfer_id, layout, expected_hashes, self.allow_shm, in_place)
        except KVIntegrityError as e:
            self._release(conn, wire.Release(transfer_id, ok=False, reason=str(e)))
            raise
        else:
            if payload.in_place:
                payload.on_finish(lambda problem: _release_later(conn, transfer_id, problem))
                deferred = True
            else:
                self._release(conn, wire.Release(transfer_id))
            return payload
        finally:
            if not deferred:
                conn.close()

    def close(self) -> None:
        # destroy, not term: a payload left in place and never finished still has its socket open.
        self._ctx.destroy(linger=1000)

    def __enter__(self) -> "KVFetcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _pull(self, conn: _Connection, transfer_id: str, layout: KVLayout, expected: list[bytes],
              use_shm: bool, in_place: bool) -> KVPayload:
        lease_s = max(0.0, conn.deadline - time.monotonic())  # how long the source keeps a segment for us
        conn.send(wire.Fetch(transfer_id, layout, wire.host_id(), use_shm, lease_s, shm_checksums=not in_place))
        msg = conn.recv("a reply")
        header = _decode(wire.decode_reply, msg[0], f"transfer {transfer_id}: reply")
        if isinstance(header, wire.Refused):
            error = KVIntegrityError if header.integrity else KVTransferError
            raise error(f"{conn.endpoint}: transfer {transfer_id} refused: {header.reason}")
        _check_header(header, transfer_id, layout, expected)
        per_layer = len(layout.frame_specs(1))
        if header.mode == "blocks":  # one message: ZeroMQ's frames, wrapped without a copy
            frames = [frame_tensor(memoryview(f)) for f in msg[1:]]
            _check_frames(transfer_id, frames, header.frame_nbytes, header.frame_checksum, 0, per_layer)
        elif header.mode == "layers":
            _expect_no_data(header, msg)
            offsets, size = wire.frame_offsets(header.frame_nbytes)
            copier = LayerCopier(transfer_id, header.frame_nbytes, offsets, per_layer, self.buffers.take(size))
            frames = self._recv_layers(conn, header, per_layer, copier.layer)
        elif header.mode == "shm":
            _expect_no_data(header, msg)
            copier = _open_segment(header, per_layer, None if in_place else self.buffers)
            if copier is None:  # not visible here (another /dev/shm namespace): ask again, over TCP
                self._recv_layers(conn, header, per_layer, None)  # skip the announcements still on their way
                return self._pull(conn, transfer_id, layout, expected, False, in_place)
            frames = self._recv_layers(conn, header, per_layer, copier.layer, checksums=not in_place)
        else:
            raise KVIntegrityError(f"transfer {transfer_id}: unknown transfer mode {header.mode!r}")
        payload = KVPayload(transfer_id, header.layout, header.block_hashes, header.token_ids,
                            _typed(frames, layout, len(expected)), sum(header.frame_nbytes))
        check_payload(payload, layout, expected)
        if header.mode == "shm" and in_place:
            payload.valid_until = conn.deadline  # the source's lease on the segment lasts at least this long
        return payload

    def _recv_layers(self, conn: _Connection, header: wire.Header, per_layer: int,
                     read_layer: Callable[[int, list[zmq.Frame]], list[torch.Tensor]] | None,
                     checksums: bool = True) -> list[torch.Tensor]:
        """Layer by layer, each checked as it arrives while the source is still producing the next one.

        `read_layer(i, data frames of layer i's message)` gives layer i's tensors; None only skips the messages.
        `checksums` False: sizes only (a shared-memory segment read in place, see wire.Fetch).
        """
        tid, num_layers = header.transfer_id, header.layout.num_layers
        frames: list[torch.Tensor] = []
        for i in range(num_layers):
            msg = conn.recv(f"layer {i} of {num_layers}")
            meta = _decode(wire.decode_layer, msg[0], f"transfer {tid}: layer {i} header")
            if meta.index != i:
                raise KVIntegrityError(f"transfer {tid}: got layer {meta.index}, expected {i}")
            if read_layer is None:
                continue
            layer = read_layer(i, msg[1:])
            sizes = header.frame_nbytes[len(frames) : len(frames) + per_layer]
            _check_frames(tid, layer, sizes, meta.frame_checksum if checksums else None, len(frames), per_layer)
            frames += layer
        return frames

    def _release(self, conn: _Connection, msg: wire.Release) -> None:
        conn.send(msg)
        wait_until = time.monotonic() + self.release_wait_s
        try:
            while True:  # skip what is still in flight (the rest of a rejected payload)
                reply = conn.recv("the release confirmation", wait_until)
                try:
                    if isinstance(wire.decode_released(reply[0].buffer), wire.Released | wire.Refused):
                        return
                except msgspec.DecodeError:
                    continue
        except KVTransferError as e:
            log.warning("kv transfer %s: release not confirmed (the source releases it on timeout): %s",
                        msg.transfer_id, e)


def _release_later(conn: _Connection, transfer_id: str, problem: str | None) -> None:
    """Ack an in-place payload once its reader is done. Asks for no confirmation and does not wait, so the
    engine thread may call it; ZeroMQ delivers the message after the socket is closed."""
    try:
        conn.send(wire.Release(transfer_id, ok=problem is None, reason=problem or "", confirm=False))
    except KVTransferError as e:  # the source releases it when the lease runs out
        log.warning("kv transfer %s: release not sent: %s", transfer_id, e)
    finally:
        conn.close(linger_ms=1000)


def _decode(decoder: Callable[[memoryview], T], frame: zmq.Frame, what: str) -> T:
    try:
        return decoder(frame.buffer)
    except msgspec.DecodeError as e:
        raise KVIntegrityError(f"{what} is malformed: {e}") from e


def _check_header(header: wire.Header, transfer_id: str, layout: KVLayout, expected: list[bytes]) -> None:
    if header.transfer_id != transfer_id:
        raise KVIntegrityError(f"asked for transfer {transfer_id}, got {header.transfer_id}")
    diffs = layout.mismatches(header.layout)
    if diffs:
        raise KVIntegrityError(f"transfer {transfer_id}: KV layout mismatch: {'; '.join(diffs)}")
    check_hashes(transfer_id, header.block_hashes, expected)
    sizes = layout.frame_nbytes(len(expected)) * layout.num_layers
    if header.frame_nbytes != sizes:
        raise KVIntegrityError(f"transfer {transfer_id}: header's frame sizes do not match the layout "
                               f"({len(header.frame_nbytes)} frames, {sum(header.frame_nbytes)} bytes; "
                               f"expected {len(sizes)}, {sum(sizes)})")


def _expect_no_data(header: wire.Header, msg: list[zmq.Frame]) -> None:
    if len(msg) != 1:
        raise KVIntegrityError(f"transfer {header.transfer_id}: {len(msg) - 1} stray data frames in a "
                               f"{header.mode} header")


def _check_frames(tid: str, frames: list[torch.Tensor], sizes: list[int], sums: list[int] | None, first: int,
                  per_layer: int) -> None:
    """Count, sizes and checksums (unless `sums` is None) of `frames`, which are frames first, first + 1, ...
    of the transfer."""
    if len(frames) != len(sizes) or (sums is not None and len(sums) != len(sizes)):
        raise KVIntegrityError(f"transfer {tid}: {len(frames)} data frames and {len(sums or [])} checksums, "
                               f"expected {len(sizes)} (short or padded transfer)")
    for k, (f, n) in enumerate(zip(frames, sizes, strict=True)):
        name = f"layer {(first + k) // per_layer} {TENSOR_NAMES[(first + k) % per_layer]}"
        if f.numel() != n:
            raise KVIntegrityError(f"transfer {tid}: {name} has {f.numel()} bytes, expected {n}")
        if sums is not None and wire.checksum(wire.as_bytes(f)) != sums[k]:
            raise KVIntegrityError(f"transfer {tid}: {name} fails its checksum (corrupted in transit)")


def _open_segment(header: wire.Header, per_layer: int, buffers: WarmBuffers | None) -> LayerCopier | None:
    """A copier out of the reply's segment (`buffers` None: views in place); None when the segment is not
    visible here."""
    offsets, size = wire.frame_offsets(header.frame_nbytes)
    segment = shm.read(header.shm_name, size)
    if segment is None:
        return None
    if segment.size < size:
        raise KVIntegrityError(f"transfer {header.transfer_id}: shared-memory segment holds {segment.size} "
                               f"bytes, expected {size} (short transfer)")
    dst = None if buffers is None else buffers.take(size)
    return LayerCopier(header.transfer_id, header.frame_nbytes, offsets, per_layer, dst, segment)


def _typed(frames: list[torch.Tensor], layout: KVLayout, num_blocks: int) -> list[list[torch.Tensor]]:
    specs = layout.frame_specs(num_blocks)
    tensors = [f.view(dtype).view(shape) for f, (dtype, shape) in zip(frames, specs * layout.num_layers,
                                                                       strict=True)]
    return [tensors[i : i + len(specs)] for i in range(0, len(tensors), len(specs))]
