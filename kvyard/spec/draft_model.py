"""Drafting with a smaller model that shares the target's tokenizer (e.g. Qwen2.5-Coder 0.5B for 1.5B).

The draft model runs on the engine's own machinery: a DecoderModel, a paged KV cache with a
BlockManager of its own, and a ModelRunner. Each target request has a shadow request in the drafter
that follows its verified tokens. Drafting k tokens is k greedy forward passes over all drafting
requests at once: the first catches the shadow up with the tokens verified since last time (a prompt,
or the accepted drafts plus the target's own token), the others are single-token decodes. Rejected
drafts need no undo: the next sync keeps the drafter's KV only up to the first token that differs.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvyard.engine.block_manager import BlockManager
from kvyard.engine.kv_cache import allocate_kv_caches
from kvyard.engine.model_runner import ModelRunner
from kvyard.engine.request import Request, Status
from kvyard.engine.sampler import fast_argmax
from kvyard.engine.scheduler import ScheduledBatch
from kvyard.loader.checkpoint import load_checkpoint
from kvyard.loader.registry import resolve_model
from kvyard.models.build import build_model
from kvyard.models.decoder import DecoderModel
from kvyard.models.kv_layer import LayerKV
from kvyard.sampling_params import SamplingParams
from kvyard.spec.compat import check_same_tokenizer

_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass
class _Shadow:
    target: Request
    req: Request  # the drafter's copy: verified tokens (+ its last drafts), its own KV and block table
    verified: int  # len(target.token_ids) at the last sync: the drafter's tokens before it are verified


class DraftModelProposer:
    def __init__(
        self,
        model: DecoderModel,
        kv_caches: list[LayerKV],
        num_blocks: int,
        block_size: int,
        token_map: torch.Tensor | None = None,
    ):
        self.model = model
        # A drafter whose head scores a reduced vocabulary: its logits column i is target token token_map[i].
        self.token_map = token_map
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, kv_caches, block_size)
        self._shadows: dict[str, _Shadow] = {}

    @classmethod
    def load(
        cls,
        name: str,
        target_tokenizer,
        target_vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_blocks: int,
        block_size: int,
        max_positions: int,
    ) -> "DraftModelProposer":
        """Load the draft checkpoint; refuse it (TokenizerMismatchError) unless it shares the tokenizer."""
        path = resolve_model(name)
        ckpt = load_checkpoint(path)
        check_same_tokenizer(
            target_tokenizer, ckpt.tokenizer, target_vocab_size, ckpt.config.vocab_size, str(path)
        )
        model = build_model(ckpt.config, dtype, device, max_positions=max_positions)
        model.load(ckpt.tensors(), str(path))
        # As many blocks as the target's pool: the drafter never holds more tokens than the target does.
        kv = allocate_kv_caches(ckpt.config, num_blocks, block_size, dtype, device)
        return cls(model, kv, num_blocks, block_size)

    def propose(self, requests: Sequence[Request], num_tokens: Mapping[str, int]) -> dict[str, list[int]]:
        self._drop_stale()
        active: list[tuple[_Shadow, int]] = []
        for target in requests:
            k = num_tokens.get(target.request_id, 0)
            if k > 0 and (sh := self._prepare(target, k)) is not None:
                active.append((sh, k))
        drafts: dict[str, list[int]] = {sh.target.request_id: [] for sh, _ in active}
        while active:
            self._forward([sh for sh, _ in active], drafts)
            active = [(sh, k) for sh, k in active if len(drafts[sh.target.request_id]) < k]
        return drafts

    def _prepare(self, target: Request, k: int) -> _Shadow | None:
        sh = self._shadows.get(target.request_id)
        if sh is None:
            sh = _Shadow(target, Request(target.request_id, list(target.token_ids), _GREEDY), 0)
            self._shadows[target.request_id] = sh
        self._sync(sh)
        # The drafter feeds every verified token and k - 1 of its drafts.
        need = sh.req.num_tokens + k - 1
        if not self.blocks.can_fit(sh.req, need):
            return None  # the drafter's pool is full: this request does not speculate this step
        self.blocks.grow(sh.req, need)
        return sh

    def _sync(self, sh: _Shadow) -> None:
        mine, theirs = sh.req.token_ids, sh.target.token_ids
        keep = min(sh.req.num_computed_tokens, len(theirs) - 1)
        for i in range(min(sh.verified, keep), keep):
            if mine[i] != theirs[i]:  # the first rejected draft: KV after it was computed on a wrong path
                keep = i
                break
        del mine[keep:]
        mine.extend(theirs[keep:])
        sh.req.num_computed_tokens = keep
        sh.verified = len(theirs)

    def _forward(self, shadows: list[_Shadow], drafts: dict[str, list[int]]) -> None:
        batch = ScheduledBatch()
        for sh in shadows:
            batch.add(sh.req, sh.req.num_tokens - sh.req.num_computed_tokens)
        step = self.runner.prepare(batch)
        best = fast_argmax(self.runner.execute(step))
        tokens = (best if self.token_map is None else self.token_map[best]).tolist()
        for req, token in zip(step.sampled, tokens, strict=True):
            req.num_computed_tokens = req.num_tokens
            req.token_ids.append(token)
            drafts[req.request_id].append(token)

    def _drop_stale(self) -> None:
        """Free the shadows of requests that finished or were preempted (a resumed one starts over)."""
        for rid, sh in list(self._shadows.items()):
            if sh.target.status is not Status.RUNNING:
                self.blocks.free(sh.req)
                del self._shadows[rid]
