"""Moves KV blocks between the engine's pool and the tiers below it: host memory (host_tier.py), local disk
(disk_tier.py) and Redis shared by the replicas (redis_tier.py), each optional, looked up in that order.

- Inclusive tiers (default): a block goes to every tier, so the disk keeps what a restarted worker can use; the
  engine refuses a disk smaller than the host tier, which would add no capacity. Exclusive: a block goes to
  the host tier, and to the disk only when the host tier evicts it, so their capacities add up. Redis is shared
  by the replicas, so it gets every block at once either way (a replica's prefix is another's hit).
- Admission by reuse: with `admit_after` N > 1, a block is written only once N requests' prompts carried it, so
  one-off prompts don't churn the tiers.

- Write-back (default): a cached block that the pool evicts for room is queued for the tiers; write-through:
  every block is queued as soon as the prefix cache registers it (what a restart needs). Either way its KV stays
  intact until the next forward pass, so `write_queued` copies all the step's blocks in one gather just before
  it (and before a restore writes into the pool): a row copy per layer, not per block.
- Restore: before a request is admitted, the blocks of its prompt that follow the pool's own cached prefix and
  are in a tier, as far as loading them beats recomputing them (decision.py), go back into the pool's prefix
  cache (`BlockManager.adopt`), so the scheduler hits them like any cached prefix and the request computes only
  what neither holds. The pool's KV events report them as stored, so a cache-aware router sees them too.
- Loads can overlap compute (`overlap`): the disk's and Redis's reads run on reader threads (reader.py) while
  the request waits and the engine steps the others; it is admitted at the first step after they finish.
"""

import concurrent.futures
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from kvyard.disagg.blocks import gather_blocks, layer_tensors, pack_blocks, scatter_blocks
from kvyard.engine.block_manager import BlockManager
from kvyard.engine.kv_events import BlockRemoved, BlockStored, KVEvent
from kvyard.engine.kv_handoff import select_blocks
from kvyard.engine.request import Request
from kvyard.models.kv_layer import LayerKV
from kvyard.offload.decision import LoadOrRecompute, TierRate
from kvyard.offload.disk_tier import DiskTier
from kvyard.offload.host_tier import Evicted, HostTier, TierBlock, block_nbytes
from kvyard.offload.reader import BlockReader, ReadResult
from kvyard.offload.redis_tier import RedisTier

log = logging.getLogger(__name__)

Tier = HostTier | DiskTier | RedisTier
ByteTier = DiskTier | RedisTier
# Where a block to restore is: a slot of the host tier, or a block read from a tier of bytes
Found = tuple[HostTier, int] | tuple[ByteTier, TierBlock]
# Before a tier's load rate is measured, the share of a pool block's credit a router gives its blocks (Dynamo's)
DEFAULT_CREDITS = {"host": 0.75, "disk": 0.25, "redis": 0.25}
SEEN_LIMIT = 1 << 16  # block hashes whose uses admission by reuse remembers (least recently seen out first)


@dataclass
class Gathered:
    """Blocks copied out of the pool for the tiers that lack them, in the form each kind of tier takes."""
    items: list[tuple[bytes, tuple[int, ...], list[Tier]]]  # per block: hash, tokens, the tiers that lack it
    layers: list[list[torch.Tensor]] | None  # per layer, the blocks one after another (for the host tier)
    packed: torch.Tensor | None  # a row of bytes per block (for the disk and Redis: one buffer to write)


@dataclass
class PendingRestore:
    """A request's restore, planned: per leading block of its prompt, the tier to load it from (None: the pool
    holds it), and the reads of tiers of bytes in flight on the reader thread, by block index."""
    hashes: list[bytes]
    where: list["Tier | None"]
    reads: dict[int, "concurrent.futures.Future[ReadResult]"]


def _result(future: "concurrent.futures.Future[ReadResult]") -> ReadResult:
    try:
        return future.result()
    except Exception:  # a tier's read counts its own faults; anything else is a bug, and still only a miss
        log.exception("reading a KV block from a tier failed; its request recomputes it")
        return ReadResult(None, 0.0)


class KVOffload:
    def __init__(self, tiers: list[Tier], caches: list[LayerKV], blocks: BlockManager, block_size: int,
                 decide: LoadOrRecompute, write: str = "back", admit_after: int = 1, exclusive: bool = False,
                 overlap: bool = False):
        self.tiers = tiers
        self.decide = decide
        self.caches = caches
        self.blocks = blocks
        self.block_size = block_size
        self.restored = {t.name: 0 for t in tiers}  # blocks put back into the pool, by the tier they came from
        self.load_seconds = {t.name: 0.0 for t in tiers}  # spent reading and copying them back
        self.block_bytes = block_nbytes(tiers[0].layout) if tiers else 0  # KV bytes of one block, moved either way
        self._queued: list[tuple[int, bytes, tuple[int, ...]]] = []  # (block id, hash, tokens) to write
        self.admit_after = admit_after
        self.seen: OrderedDict[bytes, int] = OrderedDict()  # block hash -> prompts that carried it
        # Requests whose prompt `seen` has counted: one that waits for room is planned again at every step, but
        # carries its blocks once (counting it each time would admit one-off prompts that merely waited)
        self.counted: set[str] = set()
        self.not_admitted = 0  # blocks not written: too few prompts carried them
        self.seconds_restoring = 0.0  # in restore() in all (the engine's step-cost model leaves it out)
        # overlap: the disk's and Redis's reads run on a thread while the engine steps other requests; else the
        # engine waits for them (host-tier loads are memory copies, always done at once)
        overlap = overlap and any(not isinstance(t, HostTier) for t in tiers)
        self.reader = BlockReader() if overlap else None
        self.pending: dict[str, PendingRestore] = {}  # request id -> its restore, waiting on reads
        host = next((t for t in tiers if isinstance(t, HostTier)), None)
        # Exclusive: the disk is written from the host tier's evictions, not from the pool
        exclusive = exclusive and host is not None
        self.demote_to: list[DiskTier] = [t for t in tiers if isinstance(t, DiskTier)] if exclusive else []
        if host is not None and self.demote_to:
            host.keep_evicted = True
        self.write_to = [t for t in tiers if not any(t is d for d in self.demote_to)]
        # KV events of the tiers (None: nobody listens); the disk's and Redis's writers append from their threads
        self.events: deque[KVEvent] | None = None
        for t in tiers:
            t.on_change = self._changed
        if write == "through":
            blocks.on_store = self.save
        else:
            blocks.on_evict = self.save

    @property
    def restored_blocks(self) -> int:
        return sum(self.restored.values())

    # ---- writing -------------------------------------------------------------------------------------

    def save(self, block_id: int, h: bytes, tokens: tuple[int, ...]) -> None:
        if self.admit_after > 1 and self.seen.get(h, 0) < self.admit_after:
            self.not_admitted += 1
            return
        self._queued.append((block_id, h, tokens))

    def _count_uses(self, req: Request, hashes: list[bytes]) -> None:
        if self.admit_after <= 1 or req.request_id in self.counted:
            return
        self.counted.add(req.request_id)
        for h in hashes:
            self.seen[h] = self.seen.pop(h, 0) + 1
        while len(self.seen) > SEEN_LIMIT:
            self.seen.popitem(last=False)

    def write_queued(self) -> None:
        """Copy the queued blocks to the tiers that lack them: one gather out of the pool for all of them."""
        self._store(self._gather_queued())

    def _gather_queued(self) -> Gathered | None:
        """The queued blocks (and the tiers that lack each), copied out of the pool, which may then reuse them."""
        queued, self._queued = self._queued, []
        wanted = [(h, t, [tier for tier in self.write_to if tier.lacks(h)]) for _, h, t in queued]
        keep = [i for i, w in enumerate(wanted) if w[2]]
        if not keep:
            return None
        items, ids = [wanted[i] for i in keep], [queued[i][0] for i in keep]
        tiers = [tier for _, _, lacking in items for tier in lacking]
        host = any(isinstance(tier, HostTier) for tier in tiers)
        to_bytes = not all(isinstance(tier, HostTier) for tier in tiers)
        return Gathered(items, gather_blocks(self.caches, ids, self.block_size) if host else None,
                        pack_blocks([layer_tensors(c) for c in self.caches], ids, self.block_size) if to_bytes else None)

    def _store(self, gathered: Gathered | None) -> None:
        if gathered is None:
            return
        items = gathered.items
        for tier in self.write_to:
            rows = [i for i, w in enumerate(items) if tier in w[2]]
            if not rows:
                continue
            if isinstance(tier, HostTier):
                assert gathered.layers is not None
                evicted = tier.store([items[i][:2] for i in rows], select_blocks(gathered.layers, rows, self.block_size))
                if evicted is not None:
                    self._demote(evicted)
            else:
                assert gathered.packed is not None
                for i in rows:  # rows of this step's copy, which the writer keeps until it has written them
                    tier.put(items[i][0], items[i][1], gathered.packed[i])

    def _demote(self, evicted: Evicted) -> None:
        """Exclusive tiers: what the host tier evicted goes down to the disk."""
        packed = None
        for tier in self.demote_to:
            for i, (h, tokens) in enumerate(evicted.items):
                if tier.lacks(h):
                    if packed is None:
                        packed = pack_blocks(evicted.tensors, list(range(len(evicted.items))), self.block_size)
                    tier.put(h, tokens, packed[i])

    # ---- restoring -----------------------------------------------------------------------------------

    def holder(self, h: bytes, tokens: tuple[int, ...]) -> Tier | None:
        """The first tier that has this block, asked without reading it."""
        for t in self.tiers:
            if t.has(h, tokens) if isinstance(t, HostTier) else h in t:
                return t
        return None

    def _read(self, tier: Tier, h: bytes, tokens: tuple[int, ...]) -> Found | None:
        if isinstance(tier, HostTier):
            slot = tier.lookup(h, tokens)
            return None if slot is None else (tier, slot)
        entry = tier.get(h, tokens)
        return None if entry is None else (tier, entry)

    def restore(self, req: Request) -> bool:
        """Put the tiers' blocks of the request's prompt prefix back into the pool, as far as loading them is
        expected to beat recomputing them (decision.py). False while some are still being read from a tier of
        bytes on the reader thread: the scheduler lets the request wait and asks again at its next step."""
        started = time.perf_counter()
        try:
            plan = self.pending.pop(req.request_id, None) or self._plan(req)
            if plan is None:
                return True
            if not all(f.done() for f in plan.reads.values()):
                self.pending[req.request_id] = plan
                return False
            self._restore(req, plan)
            return True
        finally:
            self.seconds_restoring += time.perf_counter() - started

    def forget(self, req: Request) -> None:
        """The request finished (or was aborted) while its blocks were being read: drop its plan."""
        self.pending.pop(req.request_id, None)
        self.counted.discard(req.request_id)

    def wait_for_reads(self, timeout: float) -> None:
        """The engine has nothing to step but requests waiting on reads: sleep until one finishes."""
        if self.reader is not None and self.pending:
            self.reader.wait(timeout)

    def _plan(self, req: Request) -> "PendingRestore | None":
        """Which leading blocks of the prompt to restore, and from where; starts the reads of tiers of bytes."""
        blocks, bs = self.blocks, self.block_size
        if req.needs_prompt_logprobs or req.num_computed_tokens:
            return None
        hashes = blocks.prompt_hashes(req)
        self._count_uses(req, hashes)
        where: list[Tier | None] = []  # per leading block: the tier that has it; None: the pool has it
        for i, h in enumerate(hashes):
            tokens = tuple(req.token_ids[i * bs : (i + 1) * bs])
            if blocks.cached_block(h, tokens) is not None:
                where.append(None)
                continue
            tier = self.holder(h, tokens)
            if tier is None:
                break
            where.append(tier)
        while where and where[-1] is None:
            where.pop()  # what the pool holds after the tiers' last block needs no restoring
        if not any(w is not None for w in where):
            return None
        where = where[: self.decide.blocks_to_load([None if w is None else w.name for w in where])]
        reads = {}
        if self.reader is not None:
            for i, tier in enumerate(where):
                if tier is not None and not isinstance(tier, HostTier):
                    reads[i] = self.reader.read(tier.name, tier.get, hashes[i],
                                                tuple(req.token_ids[i * bs : (i + 1) * bs]))
        return PendingRestore(hashes, where, reads)

    def _restore(self, req: Request, plan: "PendingRestore") -> int:
        """Put the planned blocks into the pool: host slots are looked up only now (a slot found while reads
        were in flight may have been reused since); returns how many blocks were restored."""
        blocks, bs, hashes = self.blocks, self.block_size, plan.hashes
        seconds = {t.name: 0.0 for t in self.tiers}
        found: list[Found | None] = []
        for i, tier in enumerate(plan.where):
            if tier is None:
                found.append(None)
                continue
            hit: Found | None
            if i in plan.reads:
                result = _result(plan.reads[i])
                # each read's own time: the wall time until the last one also holds the queue behind other
                # requests' reads, which would make a busy tier look slow and the decision stop loading
                seconds[tier.name] += result.seconds
                hit = None if result.entry is None else (tier, result.entry)  # type: ignore[assignment]
            else:
                started = time.perf_counter()
                hit = self._read(tier, hashes[i], tuple(req.token_ids[i * bs : (i + 1) * bs]))
                seconds[tier.name] += time.perf_counter() - started
            if hit is None:  # damaged or gone since we asked: the chain stops here, the rest is recomputed
                break
            found.append(hit)
        while found and found[-1] is None:
            found.pop()
        if not found:
            return 0
        n = len(found)
        taken = blocks.adopt(req.token_ids[: n * bs], hashes[:n])
        # adopt may have evicted blocks for room: copy them out of the pool before the restore overwrites them,
        # and store them in the tiers only after it, so that no host slot it reads is reused first
        evicted = self._gather_queued()
        # A block the pool held when we looked may have been evicted by adopt itself: no copy of it here.
        lost = [b for i, b in taken if found[i] is None]
        if lost:
            blocks.forget(lost)
            blocks.release(lost)
        fill = [(b, found[i]) for i, b in taken if found[i] is not None]
        for tier in self.tiers:
            mine = [(b, at[1]) for b, at in fill if at is not None and at[0] is tier]
            if not mine:
                continue
            started = time.perf_counter()
            ids = [b for b, _ in mine]
            if isinstance(tier, HostTier):
                tier.load([slot for _, slot in mine], [layer_tensors(c) for c in self.caches], ids)  # type: ignore[misc]
            else:
                entries: list[TierBlock] = [e for _, e in mine]  # type: ignore[misc]
                per_layer = [[torch.cat(parts) for parts in zip(*(e.tensors[layer] for e in entries), strict=True)]
                             for layer in range(len(self.caches))]
                scatter_blocks(self.caches, ids, bs, per_layer)
            self.restored[tier.name] += len(ids)
            took = seconds[tier.name] + time.perf_counter() - started
            self.load_seconds[tier.name] += took
            self.decide.rates.setdefault(tier.name, TierRate()).observe(took, len(ids))
        self._store(evicted)
        if fill:
            blocks.release([b for b, _ in fill])
        return len(fill)

    # ---- KV events -----------------------------------------------------------------------------------

    def enable_events(self) -> None:
        """Start recording the tiers' changes, from what they hold now."""
        self.events = deque(BlockStored(held, None, [], self.block_size, t.medium)
                            for t in self.tiers if (held := t.held()))

    def _changed(self, medium: str, stored: list[bytes], removed: list[bytes]) -> None:
        events = self.events
        if events is None:
            return
        if removed:
            events.append(BlockRemoved(removed, medium))
        if stored:
            events.append(BlockStored(stored, None, [], self.block_size, medium))

    def take_events(self) -> list[KVEvent]:
        out: list[KVEvent] = []
        while self.events:
            out.append(self.events.popleft())
        return out

    def credits(self) -> dict[str, float]:
        """Per tier (by KV-event medium), the share of a pool block's prefill time a block there saves: one less
        its measured load time over the time to recompute it (the first block of a prompt, the cheapest)."""
        out = {}
        recompute = self.decide.recompute_seconds(0)
        for t in self.tiers:
            rate = self.decide.rates.get(t.name)
            if recompute is None or rate is None or rate.seconds_per_block is None:
                out[t.medium] = DEFAULT_CREDITS[t.name]
            else:
                out[t.medium] = round(min(1.0, max(0.0, 1.0 - rate.seconds_per_block / recompute)), 3)
        return out

    # ---- bookkeeping ---------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per tier: blocks restored, stored and evicted, bytes held and moved, seconds spent loading, and each
        kind of fallback (kvyard_kv_offload_*)."""
        out = {}
        for t in self.tiers:
            st = t.stats
            fallbacks = {k: getattr(st, k) for k in ("missing", "corrupt", "dropped", "write_errors", "unreachable")
                         if hasattr(st, k)}
            out[t.name] = {"restored": self.restored[t.name], "stored": st.stored, "evicted": st.evicted,
                           "bytes": t.used_bytes, "load_seconds": self.load_seconds[t.name],
                           "bytes_loaded": self.restored[t.name] * self.block_bytes,
                           "bytes_stored": st.stored * self.block_bytes,
                           **{"fallback_" + k: v for k, v in fallbacks.items()}}
        return out

    def flush(self) -> None:
        """Write what is queued, and wait for the slow tiers' writes."""
        self.write_queued()
        for t in self.tiers:
            if not isinstance(t, HostTier):
                t.flush()

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        for t in self.tiers:
            t.close()
