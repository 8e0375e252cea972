"""The pool of KV blocks: which are free, and which belong to each request."""

from collections import deque

from kvyard.engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_blocks) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_fit(self, req: Request, num_tokens: int) -> bool:
        """Whether the request's KV can grow to cover `num_tokens` positions."""
        extra = self.blocks_needed(num_tokens) - len(req.block_table)
        return extra <= len(self.free_blocks)

    def grow(self, req: Request, num_tokens: int) -> None:
        for _ in range(self.blocks_needed(num_tokens) - len(req.block_table)):
            req.block_table.append(self.free_blocks.popleft())

    def free(self, req: Request) -> None:
        # Blocks freed last are reused first: their memory is still warm in cache.
        self.free_blocks.extendleft(reversed(req.block_table))
        req.block_table = []
