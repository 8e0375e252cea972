"""The pool of KV blocks: which are free, which belong to each request, and which hold a known prefix.

Prefix caching: once a block is full, it is registered under a chained hash of (parent block's hash,
its tokens, the request's cache salt). A new request walks its prompt's block hashes and takes every
leading block already cached, so only the rest of the prompt is computed. Blocks are reference counted;
an unreferenced cached block stays in the pool until its memory is needed. Plain free blocks are reused
first (most recently freed first, still warm in CPU caches); cached ones are evicted least recently used,
a request's tail blocks before its head blocks, because heads are the parts other requests share.

KV events (for a cache-aware router): when enabled, every key the prefix cache gains or loses is appended
to `events` as it happens and the caller drains the list once per step (`take_events`).
"""

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvyard.engine.kv_events import BlockRemoved, BlockStored, KVEvent
from kvyard.engine.request import Request
from kvyard.engine.soft_tokens import SoftTokens, block_salt

# The hashing scheme, named so that a router can check it computes the same hashes (kv handshake).
HASH_FUNCTION = "sha256(parent|len(salt)|salt|int64 tokens)"
ROOT_HASH = b"\0" * 32  # the "parent" of a sequence's first block: the scheme's seed
# A block-table entry whose KV no layer of the pool reads any more (behind a sliding window): it holds no
# block, and its position in the table is kept so that table index = position // block_size still holds.
NULL_BLOCK = -1


def block_hash(parent: bytes | None, tokens: tuple[int, ...], salt: bytes = b"") -> bytes:
    """sha256 over the parent hash, the salt and the token ids: the identity of a block's KV."""
    h = hashlib.sha256(parent or ROOT_HASH)
    h.update(len(salt).to_bytes(4, "little") + salt)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int, salt: bytes,
                        num_blocks: int, soft: Sequence[SoftTokens] = ()) -> list[bytes]:
    """Extend `hashes` (the chain so far) in place to the first `num_blocks` full blocks of `token_ids`; a block
    that overlaps `soft` tokens hashes their digests too (kvyard/engine/soft_tokens.py)."""
    while len(hashes) < num_blocks:
        i = len(hashes)
        tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
        key_salt = block_salt(soft, salt, block_size, i) if soft else salt
        hashes.append(block_hash(hashes[-1] if hashes else None, tokens, key_salt))
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """The chained hashes of every full block of `token_ids`, as the engine registers them."""
    return extend_block_hashes([], token_ids, block_size, salt, len(token_ids) // block_size)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    tokens: tuple[int, ...] = ()  # compared on every hit, so a hash collision can never serve wrong KV


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_plain: list[int] = list(reversed(range(num_blocks)))  # a stack: pop() takes the warmest
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # front = least recently used
        self.cached: dict[bytes, int] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.events: list[KVEvent] | None = None  # None: nobody listens, record nothing
        # Called with (block id, hash, tokens) just before a cached block is evicted for reuse, while its KV is
        # still intact (kvyard/offload/ writes it to a lower tier)
        self.on_evict: Callable[[int, bytes, tuple[int, ...]], None] | None = None
        # Called the same way when `commit` registers a block in the prefix cache (write-through offload)
        self.on_store: Callable[[int, bytes, tuple[int, ...]], None] | None = None

    # ---- KV events -----------------------------------------------------------------------------------

    def enable_events(self) -> set[bytes]:
        """Start recording events; returns the hashes cached now, the state the events start from."""
        self.events = []
        return set(self.cached)

    def take_events(self) -> list[KVEvent]:
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    # ---- accounting ----------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation ----------------------------------------------------------------------------------

    # A request's table and count of committed blocks in this pool (a second pool keeps its own: window_blocks.py)

    def table(self, req: Request) -> list[int]:
        return req.block_table

    def committed(self, req: Request) -> int:
        return req.num_committed_blocks

    def set_committed(self, req: Request, n: int) -> None:
        req.num_committed_blocks = n

    def can_fit(self, req: Request, num_tokens: int, hits: Sequence[int] = ()) -> bool:
        """Whether the request's KV can grow to cover `num_tokens` positions, taking `hits` from the cache."""
        extra = self.blocks_needed(num_tokens) - len(self.table(req)) - len(hits)
        # hits that are now free blocks
        reclaimed = sum(1 for b in hits if b != NULL_BLOCK and self.blocks[b].ref_count == 0)
        return extra <= self.num_free_blocks - reclaimed

    def grow(self, req: Request, num_tokens: int, hits: Sequence[int] = ()) -> None:
        table = self.table(req)
        for b in hits:
            if b != NULL_BLOCK:
                self._take(b)
            table.append(b)
        for _ in range(self.blocks_needed(num_tokens) - len(table)):
            table.append(self._pop_free())

    def free(self, req: Request) -> None:
        table = self.table(req)
        self.release(table)
        table.clear()
        self.set_committed(req, 0)

    def hold(self, block_ids: Sequence[int]) -> list[int]:
        """One more reference on each block (KV handed to another worker must outlive its request)."""
        for b in block_ids:
            self._take(b)
        return list(block_ids)

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per block; tails go back first, so they are evicted before heads."""
        for b in reversed(block_ids):
            if b == NULL_BLOCK:
                continue
            blk = self.blocks[b]
            blk.ref_count -= 1
            if blk.ref_count == 0:
                if blk.hash is None:
                    self.free_plain.append(b)
                else:
                    self.free_cached[b] = None

    def forget(self, block_ids: Sequence[int]) -> None:
        """Take blocks out of the prefix cache (their KV turned out not to be what their hash says)."""
        for b in block_ids:
            self._evict(self.blocks[b])

    def forget_cached(self) -> None:
        """Empty the prefix cache: every free block that held a prefix becomes a plain free block (the KV
        behind the hashes is gone, as when a tensor-parallel group restarts)."""
        for b in self.free_cached:
            self._evict(self.blocks[b])
            self.free_plain.append(b)
        self.free_cached.clear()

    def _take(self, b: int) -> None:
        blk = self.blocks[b]
        if blk.ref_count == 0:
            del self.free_cached[b]
        blk.ref_count += 1

    def _pop_free(self) -> int:
        if self.free_plain:
            b = self.free_plain.pop()
        else:
            b, _ = self.free_cached.popitem(last=False)
            blk = self.blocks[b]
            if self.on_evict is not None and blk.hash is not None:
                self.on_evict(b, blk.hash, blk.tokens)
            self._evict(blk)
        self.blocks[b].ref_count = 1
        return b

    def _evict(self, blk: Block) -> None:
        if self.cached.get(blk.hash) == blk.block_id:
            del self.cached[blk.hash]
            if self.events is not None:
                self._record_removed(blk.hash)
        blk.hash, blk.tokens = None, ()

    def _record_removed(self, h: bytes) -> None:
        # Evictions come one block at a time; coalesce a run of them into one event.
        events = self.events
        assert events is not None  # only called while events are on
        if events and isinstance(events[-1], BlockRemoved):
            events[-1].block_hashes.append(h)
        else:
            events.append(BlockRemoved([h]))

    # ---- prefix caching ------------------------------------------------------------------------------

    def _hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        """The request's chained block hashes for its first `num_blocks` full blocks, extended lazily."""
        return extend_block_hashes(req.block_hashes, req.token_ids, self.block_size, req.cache_salt,
                                   num_blocks, req.soft_tokens)[:num_blocks]

    def prompt_hashes(self, req: Request) -> list[bytes]:
        """The hashes of the request's blocks a prefix hit may cover (its last token is always computed)."""
        return self._hashes(req, (req.num_tokens - 1) // self.block_size)

    def match_prefix(self, req: Request) -> list[int]:
        """Cached blocks that hold the longest prefix of the request's tokens.

        At least the last token is always left to compute: its logits are what the step samples from.
        A request that still needs its prompt logprobs takes none: a cached block has KV but no logits,
        so it computes its whole prompt (its blocks are still committed for later requests).
        """
        if not self.enable_prefix_caching or req.needs_prompt_logprobs:
            return []
        bs = self.block_size
        usable = (req.num_tokens - 1) // bs
        hits: list[int] = []
        for i, h in enumerate(self._hashes(req, usable)):
            b = self.cached_block(h, req.token_ids[i * bs : (i + 1) * bs])
            if b is None:
                break
            hits.append(b)
        return hits

    def cached_block(self, h: bytes, tokens: Sequence[int]) -> int | None:
        """The cached block under hash `h` if it holds exactly these tokens: a hash collision never serves
        another block's KV."""
        b = self.cached.get(h)
        return b if b is not None and self.blocks[b].tokens == tuple(tokens) else None

    def admit(self, req: Request, num_tokens: int, hits: Sequence[int]) -> None:
        """Give a newly scheduled request its cached prefix blocks and fresh ones up to `num_tokens`."""
        self.queried_tokens += req.num_tokens
        self.hit_tokens += len(hits) * self.block_size
        self.grow(req, num_tokens, hits)

    def adopt(self, token_ids: Sequence[int], hashes: list[bytes]) -> list[tuple[int, int]]:
        """Register KV computed elsewhere (a prefill worker) as cached blocks: (block index, block id) pairs.

        Blocks already cached are skipped; the new ones come back referenced once, for the caller to fill
        with KV and then `release`, after which they are ordinary cached blocks that a request hits. Only
        as many as the free pool holds are taken, leading blocks first (a prefix is what a request can use).
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        taken: list[tuple[int, int]] = []
        present: list[int] = []  # cached already: pinned while we allocate, so the chain keeps no holes
        for i, h in enumerate(hashes):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            b = self.cached.get(h)
            if b is not None and self.blocks[b].tokens == tokens:
                self._take(b)
                present.append(b)
                continue
            if self.num_free_blocks == 0 or b is not None:
                break  # no room, or a colliding hash: the rest of the chain is recomputed by its request
            b = self._pop_free()
            blk = self.blocks[b]
            blk.hash, blk.tokens = h, tokens
            self.cached[h] = b
            taken.append((i, b))
        self.release(present)
        if self.events is not None and taken:
            self._record_stored(token_ids, hashes, [i for i, _ in taken])
        return taken

    def commit(self, req: Request) -> None:
        """Register the request's blocks that became full of computed KV, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = req.num_computed_tokens // bs
        hashes = self._hashes(req, full)
        table = self.table(req)
        stored: list[int] = []  # indices of blocks that are new keys of the cache
        for i in range(self.committed(req), full):
            if table[i] == NULL_BLOCK:
                continue
            blk = self.blocks[table[i]]
            if blk.hash is None:
                blk.hash, blk.tokens = hashes[i], tuple(req.token_ids[i * bs : (i + 1) * bs])
                if self.cached.setdefault(blk.hash, blk.block_id) == blk.block_id:
                    stored.append(i)
                    if self.on_store is not None:
                        self.on_store(blk.block_id, blk.hash, blk.tokens)
        self.set_committed(req, max(self.committed(req), full))
        if self.events is not None and stored:
            self._record_stored(req.token_ids, hashes, stored)

    def _record_stored(self, token_ids: Sequence[int], hashes: list[bytes], indices: list[int]) -> None:
        """One BlockStored event per run of consecutive block indices."""
        bs = self.block_size
        events = self.events
        assert events is not None  # only called while events are on
        runs: list[list[int]] = []
        for i in indices:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, end = run[0], run[-1] + 1
            events.append(
                BlockStored(
                    block_hashes=hashes[first:end],
                    parent_hash=hashes[first - 1] if first else None,
                    token_ids=list(token_ids[first * bs : end * bs]),
                    block_size=bs,
                )
            )
