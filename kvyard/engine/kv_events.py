"""KV-cache events: what the prefix cache gained and lost, for routers that place requests by cache overlap.

The block manager appends events to a plain list while it works (one `append` per change, no I/O) and the
serving layer drains that list once per engine step and publishes it elsewhere (kvyard/server/kv_events.py).
The events mirror the keys of the prefix cache exactly: replaying them onto an empty set yields the set of
block hashes a new request could hit. They are msgspec structs so that the same types are the wire format.
"""

import msgspec


class BlockStored(msgspec.Struct, tag="stored", frozen=True):
    """Consecutive blocks of one request that just entered the prefix cache.

    `parent_hash` is the hash of the block before the first one (None at the start of a sequence);
    `token_ids` holds `len(block_hashes) * block_size` tokens, block after block.
    """

    block_hashes: list[bytes]
    parent_hash: bytes | None
    token_ids: list[int]
    block_size: int


class BlockRemoved(msgspec.Struct, tag="removed", frozen=True):
    """Blocks whose KV was evicted: a request can no longer hit them."""

    block_hashes: list[bytes]


class AllBlocksCleared(msgspec.Struct, tag="all_cleared", frozen=True):
    """The whole prefix cache was dropped."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def apply_events(hashes: set[bytes], events: list[KVEvent]) -> None:
    """Replay events onto a set of cached block hashes (the one place that defines what they mean)."""
    for ev in events:
        if isinstance(ev, BlockStored):
            hashes.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            hashes.difference_update(ev.block_hashes)
        else:
            hashes.clear()
