"""KV blocks of sliding-window layers: blocks a window has left behind go back to the pool.

A sliding layer's query at position q sees keys q - window + 1 .. q, and q only grows, so a block whose
last position is at or before (next position) - window is never read again by those layers. It is given
back (`NULL_BLOCK` keeps its place in the table); its KV stays in the prefix cache until the pool needs
the block, like any other released block. A request's memory in such a pool is bounded by its window
(plus the chunk it is computing), however long it grows.

Two arrangements:
- every layer slides with the same window (Mistral): the request's only table lives in a `WindowBlocks`;
- sliding and full-attention layers mixed (Gemma 3: five local layers for each global one): `HybridBlocks`
  keeps the full layers' blocks as before and the sliding layers' in a second pool of their own, with its
  own table per request (`Request.window_table`), sized so that every running request's window fits.

A prefix-cache hit of h blocks needs, for the sliding layers, only the blocks that the window ending at
position h * block_size covers; `window_hits` finds them by the same chained hashes. With attention sinks the
blocks of the first `sinks` positions are seen by every query: they are never given back, and a hit needs them.
"""

from collections.abc import Sequence

from kvyard.engine.block_manager import NULL_BLOCK, BlockManager
from kvyard.engine.request import Request
from kvyard.errors import ConfigError


class WindowBlocks(BlockManager):
    def __init__(self, num_blocks: int, block_size: int, window: int, enable_prefix_caching: bool = True,
                 second_pool: bool = False, sinks: int = 0):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.window = window
        self.second_pool = second_pool  # True: the request's table is window_table (HybridBlocks)
        # The blocks of the first `sinks` positions, which the sliding layers always see: never given back
        self.sink_blocks = -(-sinks // block_size)

    def table(self, req: Request) -> list[int]:
        return req.window_table if self.second_pool else req.block_table

    def committed(self, req: Request) -> int:
        return req.num_window_committed if self.second_pool else req.num_committed_blocks

    def set_committed(self, req: Request, n: int) -> None:
        if self.second_pool:
            req.num_window_committed = n
        else:
            req.num_committed_blocks = n

    def first_live_block(self, next_position: int) -> int:
        """The first block a query at `next_position` (or later) can still read."""
        return max(0, next_position - self.window + 1) // self.block_size

    def commit(self, req: Request) -> None:
        super().commit(req)  # registered first, so a block given back can still be hit
        table = self.table(req)
        i = min(self.first_live_block(req.num_computed_tokens), len(table)) - 1
        # Given-back blocks form a run after the sink blocks: walk back from the window's edge to its last one.
        while i >= self.sink_blocks and table[i] != NULL_BLOCK:
            self.release([table[i]])
            table[i] = NULL_BLOCK
            i -= 1

    def live_blocks(self, req: Request) -> int:
        return sum(1 for b in self.table(req) if b != NULL_BLOCK)

    # ---- prefix caching ------------------------------------------------------------------------------

    def window_hits(self, req: Request, num_blocks: int) -> list[int] | None:
        """Table entries for a hit of the first `num_blocks` blocks: NULL_BLOCK before the window, cached
        blocks inside it; None when one inside it is not cached."""
        return self._hits_with(self._present(req, num_blocks), num_blocks)

    def match_prefix(self, req: Request, limit: int | None = None) -> list[int]:
        """The longest hit (at most `limit` blocks) whose window is wholly cached."""
        if not self.enable_prefix_caching or req.needs_prompt_logprobs:
            return []
        usable = (req.num_tokens - 1) // self.block_size
        present = self._present(req, usable if limit is None else min(usable, limit))
        for h in range(len(present), 0, -1):
            hits = self._hits_with(present, h)
            if hits is not None:
                return hits
        return []

    def _present(self, req: Request, num_blocks: int) -> list[int | None]:
        """Per block index, the cached block holding it, or None."""
        bs = self.block_size
        return [self.cached_block(h, req.token_ids[i * bs : (i + 1) * bs])
                for i, h in enumerate(self._hashes(req, num_blocks))]

    def _hits_with(self, present: list[int | None], h: int) -> list[int] | None:
        first = self.first_live_block(h * self.block_size)
        sinks = present[: min(self.sink_blocks, first)]
        live = present[first:h]
        if any(b is None for b in sinks + live):
            return None
        return sinks + [NULL_BLOCK] * (first - len(sinks)) + live  # type: ignore[operator]


class HybridBlocks(BlockManager):
    """The full-attention layers' pool (this object: what the scheduler, stats and KV events see) and the
    sliding layers' pool (`window_pool`); a request fits when it fits both."""

    def __init__(self, num_blocks: int, window_blocks: int, block_size: int, window: int,
                 enable_prefix_caching: bool = True, sinks: int = 0):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.window_pool = WindowBlocks(window_blocks, block_size, window, enable_prefix_caching, second_pool=True,
                                        sinks=sinks)

    def _window_hits(self, req: Request, hits: Sequence[int]) -> list[int]:
        if not hits:
            return []
        found = self.window_pool.window_hits(req, len(hits))
        assert found is not None, "match_prefix returns only hits whose window is cached"
        return found

    def can_fit(self, req: Request, num_tokens: int, hits: Sequence[int] = ()) -> bool:
        return (super().can_fit(req, num_tokens, hits)
                and self.window_pool.can_fit(req, num_tokens, self._window_hits(req, hits)))

    def grow(self, req: Request, num_tokens: int, hits: Sequence[int] = ()) -> None:
        window_hits = self._window_hits(req, hits)
        super().grow(req, num_tokens, hits)
        self.window_pool.grow(req, num_tokens, window_hits)

    def free(self, req: Request) -> None:
        super().free(req)
        self.window_pool.free(req)

    def match_prefix(self, req: Request) -> list[int]:
        hits = super().match_prefix(req)
        if hits:
            hits = hits[: len(self.window_pool.match_prefix(req, limit=len(hits)))]
        return hits

    def commit(self, req: Request) -> None:
        super().commit(req)
        self.window_pool.commit(req)

    def hold(self, block_ids: Sequence[int]) -> list[int]:
        raise ConfigError("KV handoff (disaggregation) does not support models with both sliding-window and "
                          "full-attention layers yet")

    def adopt(self, token_ids: Sequence[int], hashes: list[bytes]) -> list[tuple[int, int]]:
        return self.hold(())  # type: ignore[return-value]
