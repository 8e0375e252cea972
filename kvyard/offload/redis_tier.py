"""A KV tier in Redis, shared by the replicas of one deployment: a prefix one replica computed is a hit on another.

Keys are `kvyard:kv:<fingerprint>:<block hash>`, values the block's bytes as codec.py lays them out, so a
replica only reads blocks of the same model and KV layout, and a damaged value is a counted miss. The budget
is the Redis server's own (`maxmemory` with an LRU policy, shared by every replica writing to it); each block
is also written with a time to live, so an unbounded server does not keep blocks forever.

Redis being slow or gone never stalls or fails a request: calls time out fast, a failure is counted and the
tier is skipped for a few seconds before it is tried again; writes go through a QueuedWriter off the engine's
thread. The request recomputes what the tier could not give.
"""

import hashlib
import logging
import time
from dataclasses import dataclass, field

import redis
import torch

from kvyard.engine.kv_events import SHARED_PREFIX
from kvyard.offload.codec import BlockLayout, decode_block, encode_block
from kvyard.offload.host_tier import OnChange, TierBlock, tensors_nbytes
from kvyard.offload.writer import QueuedWriter, Write

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5.0  # after a failure, the tier is skipped this long


@dataclass
class RedisStats:
    stored: int = 0
    hits: int = 0
    evicted: int = 0  # Redis evicts on its own; kept for the shared metric names
    corrupt: int = 0
    dropped: int = 0
    write_errors: int = 0
    unreachable: int = 0  # calls that failed or timed out


@dataclass
class RedisTier:
    url: str
    layout: BlockLayout
    fingerprint: str
    ttl_s: int = 24 * 3600
    timeout_s: float = 0.25
    max_pending: int = 256
    name: str = "redis"
    stats: RedisStats = field(default_factory=RedisStats)
    on_change: OnChange | None = None  # called on the writer's thread for writes

    def held(self) -> list[bytes]:
        return []  # the server's keys are every replica's: a router learns them from each replica's writes

    def __post_init__(self) -> None:
        self.client = redis.Redis.from_url(self.url, socket_timeout=self.timeout_s,
                                           socket_connect_timeout=self.timeout_s)
        self.prefix = f"kvyard:kv:{self.fingerprint}:".encode()
        # Replicas of one model writing to one server share this name in their KV events
        server = self.client.connection_pool.connection_kwargs
        address = server.get("path") or f"{server.get('host')}:{server.get('port')}"  # a unix socket, or TCP
        where = f"{address}/{server.get('db')}:{self.fingerprint}"
        self.medium = SHARED_PREFIX + hashlib.sha256(where.encode()).hexdigest()[:12]
        self.used_bytes = 0  # what this worker wrote; the server's own budget bounds the whole tier
        self._down_until = 0.0
        self.writer = QueuedWriter(None, self.name, self.max_pending, self._failed, write_many=self._write_many)

    def clear(self) -> int:
        """Delete this model's blocks from the server (every replica's); returns how many."""
        deleted = 0
        batch: list[bytes] = []
        for key in self.client.scan_iter(match=self.prefix + b"*", count=1000):
            batch.append(key)
            if len(batch) == 1000:
                deleted += self.client.delete(*batch)
                batch = []
        if batch:
            deleted += self.client.delete(*batch)
        return deleted

    def _key(self, h: bytes) -> bytes:
        return self.prefix + h.hex().encode()

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, e: Exception) -> None:
        self.stats.unreachable += 1
        if self.available:
            log.warning("Redis KV tier %s failed (%s); skipping it for %.0f s", self.url, e, RETRY_AFTER_S)
        self._down_until = time.monotonic() + RETRY_AFTER_S

    def __contains__(self, h: bytes) -> bool:
        """Whether the block can be read now (writes ask `lacks`): not while Redis is skipped or unreachable."""
        if not self.available:
            return False
        try:
            return bool(self.client.exists(self._key(h)))
        except redis.RedisError as e:
            self._failed(e)
            return False

    def lacks(self, h: bytes) -> bool:
        """Whether a write of this block is wanted: asked without a round trip (the engine's thread calls it for
        every block it writes); the writer asks Redis, and its SET NX leaves a block another replica wrote first."""
        return self.available and h not in self.writer.pending

    def put(self, h: bytes, tokens: tuple[int, ...], block: torch.Tensor) -> bool:
        if not self.available:
            return False
        queued = self.writer.submit(h, tokens, block)
        self.stats.dropped = self.writer.dropped
        return queued

    def _write_many(self, writes: list[Write]) -> None:
        """Every queued block in two pipelined round trips: which are there already (asked here, on the writer's
        thread, so that a block's bytes cross only when wanted), then SET NX for the others. Pipelining takes
        the per-command cost (a syscall each way, on both sides) off the cores the forward pass runs on."""
        if not self.available:
            return
        keys = [self._key(h) for h, _, _ in writes]
        asking = self.client.pipeline(transaction=False)
        for key in keys:
            asking.exists(key)
        wanted = [(key, w) for key, w, there in zip(keys, writes, asking.execute(), strict=True) if not there]
        if not wanted:
            return
        setting = self.client.pipeline(transaction=False)
        sizes = []
        for key, (_, tokens, block) in wanted:
            data = encode_block(tokens, block)
            setting.set(key, data, ex=self.ttl_s, nx=True)
            sizes.append(len(data))
        stored = [(w[0], size) for (_, w), size, done in zip(wanted, sizes, setting.execute(), strict=True)
                  if done]  # a SET NX that did nothing: another replica wrote the block meanwhile
        self.stats.stored += len(stored)
        self.used_bytes += sum(size for _, size in stored)
        if stored and self.on_change is not None:
            self.on_change(self.medium, [h for h, _ in stored], [])

    def get(self, h: bytes, tokens: tuple[int, ...]) -> TierBlock | None:
        if not self.available:
            return None
        try:
            data = self.client.get(self._key(h))
        except redis.RedisError as e:
            self._failed(e)
            return None
        if data is None:
            self._gone(h)
            return None
        tensors = decode_block(data, tokens, self.layout)  # type: ignore[arg-type]
        if tensors is None:
            self.stats.corrupt += 1
            self._gone(h)
            return None
        self.stats.hits += 1
        return TierBlock(tokens, tensors, tensors_nbytes(tensors))

    def _gone(self, h: bytes) -> None:
        if self.on_change is not None:
            self.on_change(self.medium, [], [h])

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
        self.client.close()
