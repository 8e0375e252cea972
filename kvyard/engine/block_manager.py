"""The pool of KV blocks: which are free, which belong to each request, and which hold a known prefix.

Prefix caching: once a block is full, it is registered under a chained hash of (parent block's hash,
its tokens, the request's cache salt). A new request walks its prompt's block hashes and takes every
leading block already cached, so only the rest of the prompt is computed. Blocks are reference counted;
an unreferenced cached block stays in the pool until its memory is needed. Plain free blocks are reused
first (most recently freed first, still warm in CPU caches); cached ones are evicted least recently used,
a request's tail blocks before its head blocks, because heads are the parts other requests share.
"""

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvyard.engine.request import Request


def block_hash(parent: bytes | None, tokens: tuple[int, ...], salt: bytes = b"") -> bytes:
    """sha256 over the parent hash, the salt and the token ids: the identity of a block's KV."""
    h = hashlib.sha256(parent or b"\0" * 32)
    h.update(len(salt).to_bytes(4, "little") + salt)
    h.update(array("q", tokens).tobytes())
    return h.digest()


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

    def can_fit(self, req: Request, num_tokens: int, hits: Sequence[int] = ()) -> bool:
        """Whether the request's KV can grow to cover `num_tokens` positions, taking `hits` from the cache."""
        extra = self.blocks_needed(num_tokens) - len(req.block_table) - len(hits)
        reclaimed = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # hits that are now free blocks
        return extra <= self.num_free_blocks - reclaimed

    def grow(self, req: Request, num_tokens: int, hits: Sequence[int] = ()) -> None:
        for b in hits:
            self._take(b)
            req.block_table.append(b)
        for _ in range(self.blocks_needed(num_tokens) - len(req.block_table)):
            req.block_table.append(self._pop_free())

    def free(self, req: Request) -> None:
        for b in reversed(req.block_table):
            blk = self.blocks[b]
            blk.ref_count -= 1
            if blk.ref_count == 0:
                if blk.hash is None:
                    self.free_plain.append(b)
                else:
                    self.free_cached[b] = None
        req.block_table = []
        req.num_committed_blocks = 0

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
            self._evict(self.blocks[b])
        self.blocks[b].ref_count = 1
        return b

    def _evict(self, blk: Block) -> None:
        if self.cached.get(blk.hash) == blk.block_id:
            del self.cached[blk.hash]
        blk.hash, blk.tokens = None, ()

    # ---- prefix caching ------------------------------------------------------------------------------

    def _hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        """The request's chained block hashes for its first `num_blocks` full blocks, extended lazily."""
        bs = self.block_size
        hashes = req.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            tokens = tuple(req.token_ids[i * bs : (i + 1) * bs])
            hashes.append(block_hash(hashes[-1] if hashes else None, tokens, req.cache_salt))
        return hashes[:num_blocks]

    def match_prefix(self, req: Request) -> list[int]:
        """Cached blocks that hold the longest prefix of the request's tokens.

        At least the last token is always left to compute: its logits are what the step samples from.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        usable = (req.num_tokens - 1) // bs
        hits: list[int] = []
        for i, h in enumerate(self._hashes(req, usable)):
            b = self.cached.get(h)
            if b is None or self.blocks[b].tokens != tuple(req.token_ids[i * bs : (i + 1) * bs]):
                break
            hits.append(b)
        return hits

    def admit(self, req: Request, num_tokens: int, hits: Sequence[int]) -> None:
        """Give a newly scheduled request its cached prefix blocks and fresh ones up to `num_tokens`."""
        self.queried_tokens += req.num_tokens
        self.hit_tokens += len(hits) * self.block_size
        self.grow(req, num_tokens, hits)

    def commit(self, req: Request) -> None:
        """Register the request's blocks that became full of computed KV, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = req.num_computed_tokens // bs
        hashes = self._hashes(req, full)
        for i in range(req.num_committed_blocks, full):
            blk = self.blocks[req.block_table[i]]
            if blk.hash is None:
                blk.hash, blk.tokens = hashes[i], tuple(req.token_ids[i * bs : (i + 1) * bs])
                self.cached.setdefault(blk.hash, blk.block_id)
        req.num_committed_blocks = max(req.num_committed_blocks, full)
