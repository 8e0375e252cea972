"""Following one worker's KV events into the prefix index, and resyncing from its snapshot after a gap.

The subscriber keeps `seq`, the number of the last batch it applied. A batch with `seq + 1` applies; one
with an older number (already in the snapshot) is skipped; a heartbeat repeats `seq`; anything else (a
higher number: PUB dropped messages; another `instance_id`: the worker restarted) means the index may be
wrong for this worker, so it fetches `GET /kv/snapshot`, replaces the worker's entries and continues from
the snapshot's `seq`. Messages that arrive meanwhile wait in the socket and are sorted out by number.
"""

import asyncio
import logging
from collections.abc import Callable
from urllib.parse import urlsplit

import httpx
import msgspec
import zmq
import zmq.asyncio

from kvyard.cluster.auth import present_token
from kvyard.engine.kv_events import DEVICE, BlockRemoved, BlockStored
from kvyard.router.prefix_index import PrefixIndex
from kvyard.server.kv_events import KVEventBatch, KVSnapshot

log = logging.getLogger(__name__)

_RECV_TIMEOUT_S = 0.5


def reachable_endpoint(endpoint: str, worker_url: str) -> str:
    """A worker bound to all interfaces announces tcp://0.0.0.0:P; reach it where its HTTP API is."""
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    if host in ("0.0.0.0", "*", "", "[::]"):
        return f"tcp://{urlsplit(worker_url).hostname}:{endpoint.rpartition(':')[2]}"
    return endpoint


class KVEventSubscriber:
    def __init__(
        self,
        worker_url: str,
        endpoint: str,
        index: PrefixIndex,
        client: httpx.AsyncClient,
        on_resync: Callable[[str], None] = lambda reason: None,
        on_events: Callable[[int], None] = lambda n: None,
        token: str | None = None,
    ):
        self.worker_url = worker_url
        self.token = token  # the fleet's cluster token, for a publisher that asks for it
        self.endpoint = reachable_endpoint(endpoint, worker_url)
        self.index = index
        self.client = client
        self.on_resync = on_resync
        self.on_events = on_events
        self.instance_id: str | None = None
        self.seq = -1  # -1: not in sync
        self.resyncs = 0
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kv-events {self.worker_url}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def invalidate(self) -> None:
        """Forget what we know (the worker was declared dead); the next message triggers a resync."""
        self.seq = -1
        self.index.drop(self.worker_url)

    async def _run(self) -> None:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        present_token(sock, self.token)
        sock.connect(self.endpoint)
        try:
            while True:
                try:
                    msg = await asyncio.wait_for(sock.recv(), _RECV_TIMEOUT_S)
                except TimeoutError:
                    continue
                try:
                    await self.handle(self._decoder.decode(msg))
                except (httpx.HTTPError, msgspec.DecodeError) as e:
                    log.warning("KV events of %s: %s; will resync", self.worker_url, e)
                    self.seq = -1
                except Exception:  # a bug must not silently stop following this worker
                    log.exception("KV events of %s: unexpected failure; will resync", self.worker_url)
                    self.seq = -1
        finally:
            sock.close()
            ctx.term()

    async def handle(self, batch: KVEventBatch) -> None:
        if batch.instance_id != self.instance_id:
            await self.resync("restart" if self.instance_id is not None else "start")
        elif self.seq < 0:
            await self.resync("invalidated")
        elif batch.seq > self.seq + (1 if batch.events else 0):
            await self.resync("gap")
        if batch.instance_id == self.instance_id and batch.seq == self.seq + 1 and batch.events:
            self.apply(batch)
        if batch.instance_id == self.instance_id:
            self.index.tiers.set_credits(self.worker_url, batch.credits)
        # else: already part of the snapshot (older), or a heartbeat at our seq: nothing to do

    def apply(self, batch: KVEventBatch) -> None:
        tiers = self.index.tiers
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                if ev.medium == DEVICE:
                    self.index.add(self.worker_url, ev.block_hashes)
                else:
                    tiers.add(self.worker_url, ev.medium, ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                if ev.medium == DEVICE:
                    self.index.remove(self.worker_url, ev.block_hashes)
                else:
                    tiers.remove(self.worker_url, ev.medium, ev.block_hashes)
            else:
                self.index.clear_pool(self.worker_url)  # the pool was dropped; the tiers keep theirs
        self.seq = batch.seq
        self.on_events(len(batch.events))

    async def resync(self, reason: str) -> None:
        r = await self.client.get(self.worker_url + "/kv/snapshot", timeout=10.0)
        r.raise_for_status()
        snap = msgspec.json.decode(r.content, type=KVSnapshot)
        self.index.replace(self.worker_url, (bytes.fromhex(h) for h in snap.block_hashes),
                           {m: [bytes.fromhex(h) for h in hs] for m, hs in snap.tiers.items()})
        self.instance_id, self.seq = snap.instance_id, snap.seq
        self.resyncs += 1
        log.info(
            "KV index of %s resynced (%s): %d blocks at seq %d",
            self.worker_url,
            reason,
            len(snap.block_hashes),
            snap.seq,
        )
        self.on_resync(reason)
