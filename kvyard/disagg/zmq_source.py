"""The prefill side of KV transfer over ZeroMQ: `KVSource`, one thread with a ROUTER socket.

The source owns the timing of every offered transfer: blocks stay held until the fetcher acknowledges
(`Release`) or the offer's timeout passes, and then `on_release` runs exactly once, on the source thread.
Reads happen on that same thread, so a timeout can never fire in the middle of one; a shared-memory reply
also holds the transfer for the fetcher's lease (its remaining timeout) while the fetcher (or, read in
place, the decode engine) copies the segment out. Only then does the segment go back to the pool (`shm_pool`) for another transfer. TCP
replies are gathered into warm staging memory (`warm_buffers`) and go out zero-copy from there (zmq keeps
them referenced until sent, which keeps the buffer from reuse); in "layers" and shared-memory replies the
fetcher receives layer i while this thread gathers layer i + 1. The protocol is in `wire.py`.

Reading `caches` here while the engine thread runs other requests is safe: held blocks are reference
counted by the engine and never written until `on_release` lets them go.
"""

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch
import zmq

from kvyard.cluster.auth import guard_server_socket
from kvyard.disagg import shm, wire
from kvyard.disagg.blocks import block_index, gather_layer
from kvyard.disagg.layout import KVLayout
from kvyard.disagg.payload import KVTransferError
from kvyard.disagg.shm_pool import SegmentPool
from kvyard.disagg.warm_buffers import WarmBuffers
from kvyard.models.kv_layer import LayerKV

log = logging.getLogger(__name__)

MODES = ("blocks", "layers")
TICK_S = 0.05  # the longest the source sleeps: how late a timeout or close() may be noticed
RECENT = 1024  # released transfer ids remembered, to tell "released by ack" from "never offered"


@dataclass
class KVSourceStats:
    offered: int = 0
    served: int = 0  # fetches answered with data (a transfer may be fetched again after a failure)
    served_shm: int = 0
    bytes_sent: int = 0  # data bytes sent or written into shared memory
    refused: int = 0  # unknown or released transfer id, layout mismatch, malformed request
    send_errors: int = 0
    released_by_ack: int = 0
    released_by_reject: int = 0  # the fetcher received the payload and found it unusable
    released_by_timeout: int = 0
    released_on_close: int = 0
    callback_errors: int = 0


@dataclass
class _Held:
    transfer_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    token_ids: list[int]
    on_release: Callable[[], None]
    deadline: float
    lease_until: float = 0.0  # a same-host fetcher may still be copying the segment until then
    segment: shm.SharedMemory | None = None

    @property
    def release_at(self) -> float:
        return max(self.deadline, self.lease_until)


class KVSource:
    def __init__(self, caches: list[LayerKV], block_size: int, bind: str = "tcp://127.0.0.1:0", *,
                 advertise_host: str | None = None, mode: str = "blocks", allow_shm: bool = True,
                 token: str | None = None):
        """`token`: the fleet's cluster token; fetchers that do not present it are refused at connection."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.caches, self.block_size, self.mode, self.allow_shm = caches, block_size, mode, allow_shm
        self.layout = KVLayout.of(caches, block_size)
        self.num_blocks = caches[0].k.shape[0] // block_size
        self.stats = KVSourceStats()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # never drop: a ROUTER at its high-water mark discards silently
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished fetcher is an error, not a silent drop
        self._sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # requests are small; anything else is not a fetcher
        self._auth = guard_server_socket(self._ctx, self._sock, token)
        self._sock.bind(bind[:-2] + ":*" if bind.endswith(":0") else bind)
        self.endpoint = wire.advertised(self._sock.getsockopt_string(zmq.LAST_ENDPOINT), advertise_host)
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._recent: OrderedDict[str, str] = OrderedDict()  # transfer id -> how it was released
        self._closed = False
        self.segment_pool = SegmentPool()  # shared-memory segments: a fresh one per transfer costs its page faults
        self.buffers = WarmBuffers()  # where TCP replies are gathered, for the same reason
        self._stop = threading.Event()
        # Test hook: sees (and may alter) each message's data frames after their checksums are taken.
        self._tamper: Callable[[list[memoryview]], list[memoryview]] | None = None
        self._thread = threading.Thread(target=self._run, name="kv-source", daemon=True)
        self._thread.start()

    # ---- the caller's side (any thread) ---------------------------------------------------------------

    def offer(self, transfer_id: str, block_ids: list[int], block_hashes: list[bytes], token_ids: list[int],
              on_release: Callable[[], None], timeout_s: float) -> None:
        """Hold `block_ids` for a fetcher until it acknowledges or `timeout_s` passes, then call on_release."""
        n = len(block_ids)
        if not n or len(block_hashes) != n or len(token_ids) != n * self.block_size:
            raise ValueError(f"offer {transfer_id}: {n} blocks, {len(block_hashes)} hashes and "
                             f"{len(token_ids)} token ids (need >= 1 block, a hash each, {self.block_size} "
                             "tokens each)")
        if not all(0 <= b < self.num_blocks for b in block_ids):
            raise ValueError(f"offer {transfer_id}: block ids outside the cache's {self.num_blocks} blocks")
        held = _Held(transfer_id, list(block_ids), list(block_hashes), list(token_ids), on_release,
                     time.monotonic() + timeout_s)
        with self._lock:
            if self._closed:
                raise KVTransferError(f"offer {transfer_id}: the KV source is closed")
            if transfer_id in self._held:
                raise ValueError(f"offer {transfer_id}: already offered")
            self._held[transfer_id] = held
            self.stats.offered += 1

    def warm_shm(self, num_blocks: int) -> bool:
        """Fault in a shared-memory segment for a reply of `num_blocks` now, so that no transfer pays for it
        (136 ms for 46 MB here, more than the transfer); False when /dev/shm or the pool cannot keep it."""
        return self.allow_shm and self.segment_pool.warm(self._reply_nbytes(num_blocks))

    @property
    def num_held(self) -> int:
        return len(self._held)

    def close(self) -> None:
        """Stop serving; every transfer still held is released (on_release called) before this returns."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def __enter__(self) -> "KVSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the source thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sock.poll(self._sleep_ms()):
                    msg = self._sock.recv_multipart()
                    try:
                        self._handle(msg)
                    except Exception:  # one bad request must not stop the thread every transfer depends on
                        log.exception("kv source: request failed")
                        self._refuse(msg[0], "internal error in the KV source (see its log)")
                self._expire(time.monotonic())
        finally:
            with self._lock:
                self._closed = True
                rest = list(self._held.values())
                self._held.clear()
            for held in rest:
                self._finish(held, "close")
            self.segment_pool.close()
            self._sock.close(linger=0)
            if self._auth is not None:
                self._auth.stop()
            self._ctx.term()

    def _sleep_ms(self) -> int:
        with self._lock:
            first = min((h.release_at for h in self._held.values()), default=math.inf)
        return max(0, math.ceil(1000 * min(first - time.monotonic(), TICK_S)))

    def _handle(self, msg: list[bytes]) -> None:
        peer = msg[0]
        try:
            req = wire.decode_request(msg[1]) if len(msg) == 2 else None
        except msgspec.DecodeError:
            req = None
        if isinstance(req, wire.Release):
            self._on_release_msg(peer, req)
        elif isinstance(req, wire.Fetch):
            self._serve(peer, req)
        else:
            self._refuse(peer, "malformed request")

    def _serve(self, peer: bytes, req: wire.Fetch) -> None:
        with self._lock:
            held = self._held.get(req.transfer_id)
            released = self._recent.get(req.transfer_id)
        if held is None:
            why = f"released by {released}" if released else "never offered here"
            self._refuse(peer, f"unknown transfer id {req.transfer_id!r} ({why})")
            return
        diffs = req.layout.mismatches(self.layout)
        if diffs:
            self._refuse(peer, f"KV layout mismatch: {'; '.join(diffs)}", integrity=True)
            return
        index = block_index(held.block_ids, self.caches[0].k.device)
        same_host = self.allow_shm and req.shm and req.host_id and req.host_id == wire.host_id()
        try:
            if not (same_host and self._send_shm(peer, held, index, req.lease_s, req.shm_checksums)):
                if self.mode == "layers":
                    self._send_layers(peer, held, index, self._staging(len(held.block_ids)))
                else:
                    self._send_blocks(peer, held, index)
            self.stats.served += 1
        except zmq.ZMQError as e:  # the fetcher went away mid-send; the transfer stays held
            self.stats.send_errors += 1
            log.warning("kv transfer %s: sending failed: %s", held.transfer_id, e)

    def _header(self, held: _Held, mode: str, sums: list[int], shm_name: str = "") -> wire.Header:
        nbytes = self.layout.wire_nbytes(len(held.block_ids))
        return wire.Header(held.transfer_id, mode, self.layout, held.block_hashes, held.token_ids, nbytes, sums,
                           shm_name)

    def _reply_nbytes(self, num_blocks: int) -> int:
        """Bytes of a reply laid out in one buffer or segment (wire.frame_offsets)."""
        return wire.frame_offsets(self.layout.wire_nbytes(num_blocks))[1]

    def _staging(self, num_blocks: int) -> list[list[torch.Tensor]]:
        """Per layer, where a TCP reply is gathered: warm memory, reused once ZeroMQ has sent every frame of
        it (a frame queued zero-copy keeps its buffer referenced, see warm_buffers)."""
        return wire.frame_views(torch.from_numpy(self.buffers.take(self._reply_nbytes(num_blocks))), self.layout,
                                num_blocks)

    def _layer_frames(self, i: int, index: torch.Tensor, out: list[torch.Tensor],
                      checksums: bool = True) -> tuple[list[memoryview], list[int]]:
        """Layer i gathered into `out`, as frames with their checksums. Summed layer by layer, right after
        the gather, while the bytes are still in the CPU's cache."""
        frames = [wire.as_bytes(t) for t in gather_layer(self.caches[i], index, self.block_size, out)]
        sums = [wire.checksum(f) for f in frames] if checksums else []
        return (self._tamper(frames) if self._tamper else frames), sums  # the hook sees them after summing

    def _send(self, peer: bytes, meta: msgspec.Struct, frames: list[memoryview]) -> None:
        self._sock.send_multipart([peer, wire.encode(meta), *frames], copy=False)
        self.stats.bytes_sent += sum(f.nbytes for f in frames)

    def _send_blocks(self, peer: bytes, held: _Held, index: torch.Tensor) -> None:
        frames, sums = [], []
        for i, out in enumerate(self._staging(len(held.block_ids))):
            f, c = self._layer_frames(i, index, out)
            frames += f
            sums += c
        self._send(peer, self._header(held, "blocks", sums), frames)

    def _send_layers(self, peer: bytes, held: _Held, index: torch.Tensor, views: list[list[torch.Tensor]],
                     shm_name: str = "", checksums: bool = True) -> None:
        """Header, then layer by layer: zmq's I/O thread sends layer i (or the fetcher reads it in the segment)
        while this thread gathers layer i + 1. In a segment, the frames stay there. A segment read
        in place (no checksums) has nothing to overlap on the fetcher's side, so its layers are announced
        together at the end: one wake-up of the fetcher instead of one per layer."""
        self._send(peer, self._header(held, "shm" if shm_name else "layers", [], shm_name), [])
        batched = bool(shm_name) and not checksums
        for i, out in enumerate(views):
            frames, sums = self._layer_frames(i, index, out, checksums)  # a tamper hook writes into the segment
            if not batched:
                self._send(peer, wire.LayerHeader(i, sums), [] if shm_name else frames)
        if batched:
            for i in range(len(views)):
                self._send(peer, wire.LayerHeader(i, []), [])

    def _send_shm(self, peer: bytes, held: _Held, index: torch.Tensor, lease_s: float, checksums: bool) -> bool:
        """Serve through a shared-memory segment; False (nothing sent) when there is none to be had."""
        size = self._reply_nbytes(len(held.block_ids))
        try:
            if held.segment is None:  # a second fetch of the same transfer rewrites the same bytes
                held.segment = self.segment_pool.acquire(size)
        except OSError as e:  # /dev/shm full or unavailable: TCP still works
            log.warning("kv transfer %s: no shared memory (%s), sending over TCP", held.transfer_id, e)
            return False
        held.lease_until = max(held.lease_until, time.monotonic() + lease_s)
        views = wire.frame_views(torch.frombuffer(held.segment.buf, dtype=torch.uint8), self.layout,
                                 len(held.block_ids))
        self._send_layers(peer, held, index, views, held.segment.name, checksums)
        self.stats.served_shm += 1
        self.stats.bytes_sent += size
        return True  # and no view of the segment outlives this call: it goes back to the pool on release

    def _on_release_msg(self, peer: bytes, req: wire.Release) -> None:
        with self._lock:
            held = self._held.pop(req.transfer_id, None)
        if held is not None:
            if not req.ok:
                log.warning("kv transfer %s rejected by the fetcher: %s", req.transfer_id, req.reason)
            self._finish(held, "ack" if req.ok else "reject")
        if req.confirm:
            self._reply(peer, wire.Released(found=held is not None))  # after on_release: fetch() returns after it

    def _expire(self, now: float) -> None:
        with self._lock:
            due = [h for h in self._held.values() if now >= h.release_at]
            for h in due:
                del self._held[h.transfer_id]
        for h in due:
            self._finish(h, "timeout")

    def _finish(self, held: _Held, how: str) -> None:
        with self._lock:
            self._recent[held.transfer_id] = how
            while len(self._recent) > RECENT:
                self._recent.popitem(last=False)
        if held.segment is not None:  # read before the ack (copied out or used in place), or the lease is over
            self.segment_pool.release(held.segment)
            held.segment = None
        field = "released_on_close" if how == "close" else f"released_by_{how}"
        setattr(self.stats, field, getattr(self.stats, field) + 1)
        try:
            held.on_release()
        except Exception:  # the caller's bug must not kill the thread that releases everyone else
            self.stats.callback_errors += 1
            log.exception("kv transfer %s: on_release failed", held.transfer_id)

    def _refuse(self, peer: bytes, reason: str, integrity: bool = False) -> None:
        self.stats.refused += 1
        self._reply(peer, wire.Refused(reason, integrity))

    def _reply(self, peer: bytes, msg: msgspec.Struct) -> None:
        try:
            self._sock.send_multipart([peer, wire.encode(msg)])
        except zmq.ZMQError as e:
            self.stats.send_errors += 1
            log.debug("kv source: reply to a gone fetcher dropped: %s", e)

