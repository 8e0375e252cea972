"""Continuous batching with a token budget per step, chunked prefill and preemption by recompute.

Every request is just "tokens with KV" and "tokens without"; a step gives each scheduled request some
of the missing ones. A decode is one token, a prefill chunk many, a resumed request all of its prompt
and output again. Requests that reach the end of their tokens get a new token sampled.

Stall-free batching (Sarathi-Serve): while requests decode, a step takes only the prompt tokens that keep
its predicted time (kvyard/engine/step_cost.py) within the inter-token target, so a running stream never
waits behind a big prefill chunk. The first prompt chunk of a step always gets at least a block, so prompts
keep moving however many decodes run. The automatic target gives way to a burst: when at least as many prompts
wait for their first token as streams decode, steps take the whole burst at the token budget, and a few
streams wait once rather than every stream many times. With `hold_bursts` a burst holds until each of its
prompts is prefilled, although its own first prompts soon decode and outnumber the rest.
"""

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from kvyard.config import EngineConfig
from kvyard.engine.block_manager import BlockManager
from kvyard.engine.request import Request, Status
from kvyard.engine.step_cost import StepCostModel, StepShape

# With no target set, prefill may at most double the time of a step that decodes a full batch
# (max_num_seqs requests at the running ones' mean context): the measured cost model sets the target.
AUTO_TARGET_OVER_FULL_DECODE = 2.0
# Under the automatic target (a target set by hand is kept), a burst of prompts arriving while only a few
# streams decode (at least this many prompts a stream) is admitted at the full token budget: the few streams
# wait once for the whole burst, instead of the burst being spread over many steps that each hold every stream
# (and the burst's own first tokens) to the target. Streams that start together then stay together, and later
# bursts find few streams running again. By default a burst ends once the streams (its own first prompts
# among them) outnumber its remaining prompts, which are then held to the target: 64 prompts of 130 tokens take
# five 2,048-token steps, and the last two are limited once 45 of the 64 decode. `hold_bursts` keeps the budget
# until the burst, with the prompts that arrived during its first step, is prefilled: vLLM's TTFT p99 at 64
# rather than 1.2-1.3x it, at the price of its 1.3 s stalls of the burst's first streams (BENCHMARKS.md).
BURST_PROMPTS_PER_STREAM = 1


class Restorer(Protocol):
    """Puts a waiting request's prompt blocks back into the pool from a tier below it (kvyard/offload/)."""

    def restore(self, req: Request) -> bool:
        """False while the blocks are still on their way: the request waits, and is asked about again."""
        ...

    def forget(self, req: Request) -> None: ...


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    shape: StepShape = field(default_factory=StepShape)  # what the step costs: see step_cost.py

    def add(self, req: Request, n: int) -> None:
        self.requests.append(req)
        self.num_new_tokens.append(n)
        self.shape.add(req.num_computed_tokens, n)

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
        self.cost = StepCostModel()  # the engine reports each step's time to it
        self.num_limited_chunks = 0  # prompt chunks the inter-token target shortened
        self.restorer: Restorer | None = None  # the offload tiers (kvyard/offload/), when on
        # Requests whose batch is still in a pipeline's stages: not scheduled again (nor preempted) until done
        self.in_flight: set[str] = set()
        # Batches the requests are shared out over (a pipeline's stages each working on one): a batch takes at
        # most its share of the requests, leaving the rest for the next
        self.microbatches = 1
        self.burst: set[str] = set()  # the prompts of the burst being admitted at the full budget, until prefilled
        self.burst_open = False  # the burst's first step ran: prompts that arrived during it join the burst

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        if self.restorer is not None:
            self.restorer.forget(req)
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
        decodes = StepShape()  # the running streams' next tokens (and drafts): what a prompt chunk must not stall
        streams, chunked = 0, []  # chunked: running requests still prefilling
        for req in self.running if self.stall_free else ():
            missing = req.num_tokens - req.num_computed_tokens
            if missing > 1:
                chunked.append(req)
            elif missing == 1 and req.request_id not in self.in_flight:
                decodes.add(req.num_computed_tokens, 1 + len(req.spec_token_ids))
                streams += 1
        limit = self._step_limit(decodes, burst=self._in_burst(chunked, streams))
        planned = StepShape(decodes.tokens, decodes.attended)  # decodes, plus the prompt chunks taken so far
        share = math.ceil((len(self.running) + len(self.waiting)) / self.microbatches)
        # Running requests first, oldest first; the newest is preempted when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0 and len(batch.requests) < share:
            req = self.running[i]
            if req.request_id in self.in_flight:
                i += 1
                continue
            missing = req.num_tokens - req.num_computed_tokens
            # A speculating request also verifies its drafts; drafts beyond the budget are dropped.
            n = min(missing + len(req.spec_token_ids), budget)
            if missing > 1:  # a prompt (or a preempted request's recompute) still being prefilled
                n = self._prompt_chunk(req.num_computed_tokens, n, limit, planned, decodes)
                if n == 0:
                    i += 1
                    continue
            req.spec_token_ids = req.spec_token_ids[: max(0, n - missing)]
            if not self._make_room(req, req.num_computed_tokens + n, batch):
                continue  # req itself was preempted; the list shrank
            self.blocks.grow(req, req.num_computed_tokens + n)
            if missing > 1:
                planned.add(req.num_computed_tokens, n)
            batch.add(req, n)
            budget -= n
            i += 1
        if batch.preempted:
            return batch  # memory is tight: do not admit new work this step
        i = 0
        while (i < len(self.waiting) and budget > 0 and len(self.running) < self.cfg.max_num_seqs
               and len(batch.requests) < share):
            req = self.waiting[i]
            if self.restorer is not None and not self.restorer.restore(req):
                i += 1  # its prefix is still being read from an offload tier: the requests behind it go first
                continue
            hits = self.blocks.match_prefix(req)  # the prompt's leading blocks already in the cache
            start = len(hits) * self.blocks.block_size
            n = req.num_tokens - start
            if n > budget:
                if not self.cfg.enable_chunked_prefill and batch.requests:
                    break  # whole prompts only: wait for a step with room
                n = n if not self.cfg.enable_chunked_prefill else budget
            n = self._prompt_chunk(start, n, limit, planned, decodes)
            if n == 0 or not self.blocks.can_fit(req, start + n, hits):
                break
            del self.waiting[i]
            self.blocks.admit(req, start + n, hits)
            req.num_computed_tokens = start
            req.status = Status.RUNNING
            self.running.append(req)
            batch.add(req, n)
            planned.add(start, n)
            budget -= n
        return batch

    @property
    def stall_free(self) -> bool:
        return self.cfg.stall_free

    def _in_burst(self, chunked: list[Request], streams: int) -> bool:
        """Whether this step belongs to a burst: the prompts still without their KV (waiting, or `chunked`) as
        many as the `streams` decoding, or, with `hold_bursts`, a burst begun earlier still has prompts to
        prefill. Then the prompts that arrive during a burst's first step join it; later ones wait for a burst of
        their own, or are held to the target."""
        starts = len(self.waiting) + len(chunked) >= BURST_PROMPTS_PER_STREAM * streams
        if not self.cfg.hold_bursts:
            return starts  # counted, not named: no set of ids a step on the default path
        prompts = {r.request_id for r in chunked} | {r.request_id for r in self.waiting}
        # After its first step, the burst takes in its stragglers, sent with the others but queued a moment later
        self.burst = prompts if self.burst_open else self.burst & prompts
        self.burst_open = False
        if not self.burst and prompts and starts:
            self.burst, self.burst_open = prompts, True
        return bool(self.burst)

    def _step_limit(self, decodes: StepShape, burst: bool = False) -> float | None:
        """The most seconds this step may take; None when nothing limits it: no stream decoding, stall-free
        batching off, too few steps timed yet to predict one, or a `burst` under the automatic target."""
        if not decodes.tokens or not self.stall_free or not self.cost.ready:
            return None
        if self.cfg.max_itl_ms is not None:
            return self.cfg.max_itl_ms / 1000  # a target set by hand holds for bursts too
        if burst:
            return None
        full = self.cfg.max_num_seqs
        return AUTO_TARGET_OVER_FULL_DECODE * self.cost.predict(StepShape(full, full * decodes.attended // decodes.tokens))

    def _prompt_chunk(self, start: int, n: int, limit: float | None, planned: StepShape, decodes: StepShape) -> int:
        """How many of a prompt's next `n` tokens, from position `start`, fit in this step's time limit."""
        if limit is None:
            return n
        fit = self.cost.fit_tokens(planned, start, n, limit)
        if fit < n:
            bs = self.blocks.block_size
            fit = fit // bs * bs  # whole blocks, so the chunk's KV is committed (and shareable) at once
            if planned.tokens == decodes.tokens:
                fit = max(fit, min(n, bs))  # the step's first prompt chunk: prompts always move
            self.num_limited_chunks += fit < n
        return fit

    def _make_room(self, req: Request, num_tokens: int, batch: ScheduledBatch) -> bool:
        while not self.blocks.can_fit(req, num_tokens):
            victim = next(r for r in reversed(self.running) if r.request_id not in self.in_flight)  # req at worst
            self.running.remove(victim)
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is req:
                return False
        return True

    def preempt_all(self) -> None:
        """Every running request back to the waiting queue, its KV to be recomputed (the cache was lost)."""
        for req in reversed(self.running):
            self._preempt(req)
        self.running.clear()

    def _preempt(self, req: Request) -> None:
        self.blocks.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
