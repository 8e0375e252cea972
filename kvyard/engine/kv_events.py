"""KV-cache events: what the prefix cache gained and lost, for routers that place requests by cache overlap.

The block manager appends events to a plain list while it works (one `append` per change, no I/O) and the
serving layer drains that list once per engine step and publishes it elsewhere (kvyard/server/kv_events.py).
The events mirror the keys of the prefix cache exactly: replaying them onto an empty set yields the set of
block hashes a new request could hit. They are msgspec structs so that the same types are the wire format.

`medium` says where the blocks are: `device` (the engine's pool, the default), or an offload tier below it
(`host`, `disk`, or `redis:<id>`, a tier shared by every replica that names the same id; kvyard/offload/). A
router credits a tier's blocks less than the pool's: loading them costs time (kvyard/router/tier_index.py).
"""

import msgspec

DEVICE = "device"
SHARED_PREFIX = "redis:"  # a medium shared by the replicas: one replica's write is every replica's block


def is_shared(medium: str) -> bool:
    return medium.startswith(SHARED_PREFIX)


class BlockStored(msgspec.Struct, tag="stored", frozen=True):
    """Consecutive blocks of one request that just entered the prefix cache.

    `parent_hash` is the hash of the block before the first one (None at the start of a sequence);
    `token_ids` holds `len(block_hashes) * block_size` tokens, block after block (empty for a tier's blocks:
    the router needs only the hashes).
    """

    block_hashes: list[bytes]
    parent_hash: bytes | None
    token_ids: list[int]
    block_size: int
    medium: str = DEVICE


class BlockRemoved(msgspec.Struct, tag="removed", frozen=True):
    """Blocks whose KV was evicted (from `medium`): a request can no longer hit them there."""

    block_hashes: list[bytes]
    medium: str = DEVICE


class AllBlocksCleared(msgspec.Struct, tag="all_cleared", frozen=True):
    """The whole prefix cache (the device pool) was dropped."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def apply_events(hashes: set[bytes], events: list[KVEvent], tiers: dict[str, set[bytes]] | None = None) -> None:
    """Replay events onto a set of cached block hashes (the one place that defines what they mean), and the
    tiers' events onto `tiers` (medium -> hashes; without it they are ignored)."""
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            hashes.clear()
            continue
        if ev.medium == DEVICE:
            target: set[bytes] | None = hashes
        else:
            target = None if tiers is None else tiers.setdefault(ev.medium, set())
        if target is None:
            continue
        if isinstance(ev, BlockStored):
            target.update(ev.block_hashes)
        else:
            target.difference_update(ev.block_hashes)
