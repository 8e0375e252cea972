"""Speculation inside the engine's step: who drafts how much, and what verification observed.

Before scheduling, every decoding request (all its tokens but the last have KV) gets drafts in
`req.spec_token_ids`; the scheduler gives it 1 + len(drafts) tokens of the step's budget (trimming
drafts that do not fit), the runner feeds [last token, drafts] as one short chunk over its cached
context and returns a logits row per position, and `kvyard/spec/verify.py` emits what the rows accept.
Speculation is skipped for a step when more requests decode than `max_batch`: a busy batch is already
compute-bound, where verifying drafts costs more than it saves.
"""

import time
from collections.abc import Sequence

import torch

from kvyard.engine.request import Request
from kvyard.spec.adaptive import AdaptiveK
from kvyard.spec.proposer import Proposer
from kvyard.spec.stats import SpecStats


class SpeculativeDecoding:
    def __init__(
        self, proposer: Proposer, k_max: int, max_batch: int, max_model_len: int, adaptive: bool = True
    ):
        self.proposer = proposer
        self.k = AdaptiveK(k_max, adaptive=adaptive)
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.stats = SpecStats()

    def propose(self, running: Sequence[Request]) -> None:
        """Set `spec_token_ids` of the running requests for this step (empty for most of them)."""
        for req in running:
            req.spec_token_ids = []
        self.k.retain({r.request_id for r in running})
        ready = [r for r in running if r.num_computed_tokens == r.num_tokens - 1]
        if not ready or len(ready) > self.max_batch:
            return
        ks = {r.request_id: self._cap(r, self.k.k_for(r.request_id)) for r in ready}
        asked = [r for r in ready if ks[r.request_id] > 0]
        if not asked:
            return
        start = time.perf_counter()
        drafts = self.proposer.propose(asked, ks)
        self.stats.drafter_seconds += time.perf_counter() - start
        self.stats.drafter_steps += 1
        for req in asked:
            req.spec_token_ids = list(drafts.get(req.request_id, []))[: ks[req.request_id]]

    def _cap(self, req: Request, k: int) -> int:
        # Never draft past max_tokens or the context: the verified run plus its bonus token must fit.
        left = min(req.params.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens)
        return max(0, min(k, left - 1))

    def record(self, req: Request, proposed: int, accepted: int, emitted: int) -> None:
        if proposed <= 0:
            return
        self.k.observe(req.request_id, proposed, accepted)
        s = self.stats
        s.proposed_tokens += proposed
        s.accepted_tokens += accepted
        s.verify_steps += 1
        s.emitted_tokens += emitted


def split_logits(
    sampled: Sequence[Request], num_rows: Sequence[int], logits: torch.Tensor
) -> tuple[list[Request], torch.Tensor, list[tuple[Request, torch.Tensor]]]:
    """Separate the plain rows (one per request, sampled as a batch) from each verifying request's rows."""
    if all(n == 1 for n in num_rows):
        return list(sampled), logits, []
    plain: list[Request] = []
    plain_rows: list[int] = []
    verifying: list[tuple[Request, torch.Tensor]] = []
    row = 0
    for req, n in zip(sampled, num_rows, strict=True):
        if n == 1:
            plain.append(req)
            plain_rows.append(row)
        else:
            verifying.append((req, logits[row : row + n]))
        row += n
    return plain, logits[plain_rows], verifying
