"""Publishing a worker's KV events over ZeroMQ, and the snapshot a subscriber resyncs from.

Hot path: the engine thread hands each step's events to `put`, one `SimpleQueue.put`. A publisher thread
numbers them (one batch per step, `seq` + 1 each), applies them to a mirror of the cached hashes, encodes
them with msgpack and sends them on a PUB socket. When there is nothing to say it sends a heartbeat (no
events, the current `seq`), so a subscriber notices a gap or a restart (new `instance_id`) within a second.

PUB drops messages when a subscriber is slow or not yet connected, by design. A subscriber that sees a gap
fetches `snapshot()` (over HTTP, `GET /kv/snapshot`): the mirror and the `seq` it reflects, taken under one
lock, so every batch with a higher `seq` applies on top of it. The mirror keeps the worker's own offload tiers
too (host, disk), not a tier shared with other replicas (Redis), whose keys are theirs as well; and every batch
carries the worker's measured credit per tier (kvyard/offload/manager.py `KVOffload.credits`).
"""

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable

import msgspec
import zmq

from kvyard.cluster.auth import guard_server_socket
from kvyard.engine.kv_events import AllBlocksCleared, KVEvent, apply_events, is_shared

log = logging.getLogger(__name__)


class KVEventBatch(msgspec.Struct, frozen=True):
    instance_id: str
    seq: int  # of the last batch with events; a heartbeat repeats it
    ts: float
    events: list[KVEvent]
    credits: dict[str, float] = {}  # per offload tier (medium): the share of a pool block's credit its blocks earn


class KVSnapshot(msgspec.Struct, frozen=True):
    instance_id: str
    seq: int
    block_hashes: list[str]  # hex
    tiers: dict[str, list[str]] = {}  # the worker's own offload tiers: medium -> hex hashes


_STOP = object()


class KVEventPublisher:
    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, heartbeat_s: float = 1.0, instance_id: str | None = None,
        token: str | None = None,
    ):
        """Bind a PUB socket on `host:port` (port 0: any free port, see `endpoint`); with `token`, only
        subscribers that present it connect (kvyard/cluster/auth.py)."""
        self.instance_id = instance_id or uuid.uuid4().hex
        self.heartbeat_s = heartbeat_s
        self._zmq = zmq.Context()
        self._sock = self._zmq.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._auth = guard_server_socket(self._zmq, self._sock, token)
        bind_host = "*" if host in ("0.0.0.0", "") else host
        if port == 0:
            port = self._sock.bind_to_random_port(f"tcp://{bind_host}")
        else:
            self._sock.bind(f"tcp://{bind_host}:{port}")
        self.endpoint = f"tcp://{host}:{port}"
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._hashes: set[bytes] = set()
        self._tiers: dict[str, set[bytes]] = {}
        self.credits: Callable[[], dict[str, float]] = dict  # set by whoever knows the tiers
        self._seq = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._thread: threading.Thread | None = None

    def start(self, initial: set[bytes]) -> None:
        """Start publishing from `initial`, the hashes cached when the events began."""
        self._hashes = set(initial)
        self._thread = threading.Thread(target=self._run, name="kvyard-kv-events", daemon=True)
        self._thread.start()

    def put(self, events: list[KVEvent]) -> None:
        """Called on the engine thread: must stay O(1)."""
        self._queue.put(events)

    @property
    def seq(self) -> int:
        return self._seq

    def snapshot(self) -> KVSnapshot:
        with self._lock:
            return KVSnapshot(self.instance_id, self._seq, [h.hex() for h in self._hashes],
                              {m: [h.hex() for h in hs] for m, hs in self._tiers.items() if hs})

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(5)
        self._sock.close()
        if self._auth is not None:
            self._auth.stop()
        self._zmq.term()

    def _run(self) -> None:
        try:
            while True:
                try:
                    item = self._queue.get(timeout=self.heartbeat_s)
                except queue.Empty:
                    self._send([])
                    continue
                if item is _STOP:
                    return
                self._publish(item)  # type: ignore[arg-type]
        except Exception:  # pragma: no cover - a bug; subscribers will see a gap and resync
            log.exception("the KV event publisher stopped")

    def _publish(self, events: list[KVEvent]) -> None:
        with self._lock:
            self._seq += 1
            own = [e for e in events if isinstance(e, AllBlocksCleared) or not is_shared(e.medium)]
            apply_events(self._hashes, own, self._tiers)
        self._send(events)

    def _send(self, events: list[KVEvent]) -> None:
        batch = KVEventBatch(self.instance_id, self._seq, time.time(), events, self.credits())
        self._sock.send(self._encoder.encode(batch))
