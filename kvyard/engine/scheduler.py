"""Continuous batching with a token budget per step, chunked prefill and preemption by recompute.

Every request is just "tokens with KV" and "tokens without"; a step gives each scheduled request some
of the missing ones. A decode is one token, a prefill chunk many, a resumed request all of its prompt
and output again. Requests that reach the end of their tokens get a new token sampled.
"""

from collections import deque
from dataclasses import dataclass, field

from kvyard.config import EngineConfig
from kvyard.engine.block_manager import BlockManager
from kvyard.engine.request import Request, Status


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def add(self, req: Request, n: int) -> None:
        self.requests.append(req)
        self.num_new_tokens.append(n)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, cfg: EngineConfig, blocks: BlockManager):
        self.cfg = cfg
        self.token_budget = cfg.token_budget
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.hold_kv and reason in ("stop", "length"):
            req.held_blocks = self.blocks.hold(req.block_table[: req.num_committed_blocks])
        self.blocks.free(req)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.token_budget
        # Running requests first, oldest first; the newest is preempted when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            missing = req.num_tokens - req.num_computed_tokens
            # A speculating request also verifies its drafts; drafts beyond the budget are dropped.
            n = min(missing + len(req.spec_token_ids), budget)
            req.spec_token_ids = req.spec_token_ids[: max(0, n - missing)]
            if not self._make_room(req, req.num_computed_tokens + n, batch):
                continue  # req itself was preempted; the list shrank
            self.blocks.grow(req, req.num_computed_tokens + n)
            batch.add(req, n)
            budget -= n
            i += 1
        if batch.preempted:
            return batch  # memory is tight: do not admit new work this step
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            hits = self.blocks.match_prefix(req)  # the prompt's leading blocks already in the cache
            start = len(hits) * self.blocks.block_size
            n = req.num_tokens - start
            if n > budget:
                if not self.cfg.enable_chunked_prefill and batch.requests:
                    break  # whole prompts only: wait for a step with room
                n = n if not self.cfg.enable_chunked_prefill else budget
            if not self.blocks.can_fit(req, start + n, hits):
                break
            self.waiting.popleft()
            self.blocks.admit(req, start + n, hits)
            req.num_computed_tokens = start
            req.status = Status.RUNNING
            self.running.append(req)
            batch.add(req, n)
            budget -= n
        return batch

    def _make_room(self, req: Request, num_tokens: int, batch: ScheduledBatch) -> bool:
        while not self.blocks.can_fit(req, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.blocks.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
