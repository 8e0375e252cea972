"""Turns a scheduled batch into the flat tensors one forward pass needs, and runs it."""

from dataclasses import dataclass, field

import torch

from kvyard.engine.kv_cache import KVGroups
from kvyard.engine.request import Request
from kvyard.engine.scheduler import ScheduledBatch
from kvyard.engine.soft_tokens import chunk_rows, step_embeds
from kvyard.models.attention import AttentionMetadata, PrefillSpan, causal_context_mask, position_mask
from kvyard.models.decoder import DecoderModel
from kvyard.models.kv_layer import LayerKV


@dataclass
class StepInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampled: list[Request]  # the requests whose logits rows come back, in row order
    # Logits rows of each sampled request: 1, or 1 + its drafts when it verifies speculative tokens.
    num_rows: list[int] = field(default_factory=list)
    # Prompt logprobs: (request, first position, count) of rows that follow the sampled ones; the row of
    # position p holds the logits that predicted prompt token p + 1.
    prompt_rows: list[tuple[Request, int, int]] = field(default_factory=list)


@dataclass
class _TableView:
    """The step as the layers of one block table see it (the main table, or the sliding layers' own)."""

    window: int | None  # their window when the pool gives blocks back behind it, else None
    second: bool = False  # the table is Request.window_table
    slots: list[int] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)

    def table(self, req: Request) -> list[int]:
        return req.window_table if self.second else req.block_table


class ModelRunner:
    def __init__(self, model: DecoderModel, kv_caches: list[LayerKV], block_size: int,
                 groups: KVGroups | None = None):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = model.device
        self.groups = groups or KVGroups()

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _views(self) -> list[_TableView]:
        views = [_TableView(self.groups.window)]
        if self.groups.sliding_window is not None:
            views.append(_TableView(self.groups.sliding_window, second=True))
        return views

    def prepare(self, batch: ScheduledBatch) -> StepInput:
        pairs = list(zip(batch.requests, batch.num_new_tokens, strict=True))
        # Decodes first so that they form one contiguous group for batched attention.
        pairs.sort(key=lambda rn: rn[1] != 1)
        ids: list[int] = []
        pos: list[int] = []
        logits_rows: list[int] = []
        sampled: list[Request] = []
        num_rows: list[int] = []
        prompt_rows: list[tuple[Request, int, int]] = []
        prompt_indices: list[int] = []
        decodes = [r for r, n in pairs if n == 1]
        runs: list[tuple[int, int, str | None]] = []  # (first row, rows, LoRA adapter) of each request
        soft: list[tuple[int, torch.Tensor]] = []  # (first row, embeddings) of the soft tokens in this step
        views = self._views()
        for req, n in pairs:
            start = req.num_computed_tokens
            row = len(ids)
            # Drafts to verify follow the request's last token: a short chunk over its cached context,
            # so it takes the prefill path (context slots + causal mask) and gets a row per position.
            k = len(req.spec_token_ids)
            tokens = req.token_ids + req.spec_token_ids if k else req.token_ids
            runs.append((row, n, req.lora))
            ids.extend(tokens[start : start + n])
            pos.extend(range(start, start + n))
            if req.soft_tokens and start < req.num_prompt_tokens:
                soft.extend(chunk_rows(req.soft_tokens, start, n, row))
            for view in views:
                view.slots.extend(self._slots(view.table(req), start, start + n))
                if n > 1:
                    view.prefills.append(self._prefill_span(view, req, row, n))
            if start + n == len(tokens):
                logits_rows.extend(range(row + n - 1 - k, row + n))
                sampled.append(req)
                num_rows.append(k + 1)
            if req.needs_prompt_logprobs:
                # Positions whose next token is a prompt token not yet scored (a recompute after a
                # preemption scores nothing twice); the last prompt position predicts the first output.
                first = max(start, len(req.prompt_logprobs or ()) - 1)
                end = min(start + n, req.num_prompt_tokens - 1)
                if end > first:
                    prompt_rows.append((req, first, end - first))
                    prompt_indices.extend(range(row + first - start, row + end - start))
        dev = self.device
        metas = [AttentionMetadata(slot_mapping=torch.tensor(v.slots, device=dev), block_size=self.block_size,
                                   prefills=v.prefills, sinks=self.groups.sinks) for v in views]
        if decodes:
            for view, m in zip(views, metas, strict=True):
                self._decode_metadata(view, decodes, m)
        meta = metas[0]
        meta.soft_embeds = step_embeds(soft, dev)
        if self.model.adapters:
            meta.adapter_rows = self.model.adapters.rows(runs, len(decodes), dev)
        if len(metas) > 1:
            meta.window_group = metas[1]
        return StepInput(
            input_ids=torch.tensor(ids, device=dev),
            positions=torch.tensor(pos, device=dev),
            meta=meta,
            logits_indices=torch.tensor(logits_rows + prompt_indices, device=dev, dtype=torch.long),
            sampled=sampled,
            num_rows=num_rows,
            prompt_rows=prompt_rows,
        )

    def _prefill_span(self, view: _TableView, req: Request, row: int, n: int) -> PrefillSpan:
        start = req.num_computed_tokens
        if start == 0:
            return PrefillSpan(row, row + n, None, None)
        # Behind a sliding window the blocks may be given back: the context starts at the first key the
        # chunk's first query sees. The mask is relative to the context's end, so it starts there too.
        first = 0 if view.window is None else max(0, start - view.window + 1)
        ctx = start + n
        sinks = min(self.groups.sinks, first)  # the sink positions behind `first` (none without a window)
        if sinks:
            # The window's keys after the sink positions the sliding layers also see (their blocks are kept)
            keys = torch.cat([torch.arange(sinks), torch.arange(first, ctx)]).to(self.device)
            slots = self._slots(view.table(req), 0, sinks) + self._slots(view.table(req), first, ctx)
            return PrefillSpan(row, row + n, torch.tensor(slots, device=self.device),
                               position_mask(keys[-n:], keys), keys)
        return PrefillSpan(
            row,
            row + n,
            torch.tensor(self._slots(view.table(req), first, ctx), device=self.device),
            causal_context_mask(n, ctx - first, self.device),
        )

    def _decode_metadata(self, view: _TableView, decodes: list[Request], meta: AttentionMetadata) -> None:
        lens = [r.num_computed_tokens + 1 for r in decodes]
        nblocks = -(-max(lens) // self.block_size)
        # One tensor from padded lists: a tensor per request costs more than the whole table at 32 rows.
        rows = [view.table(r)[:nblocks] for r in decodes]
        table = torch.tensor([t + [0] * (nblocks - len(t)) for t in rows], dtype=torch.long)
        if view.window is not None:
            # Given-back blocks (NULL_BLOCK) point at block 0 like padding: behind the window, never read.
            table.clamp_(min=0)
        meta.num_decodes = len(decodes)
        meta.decode_blocks = table.to(self.device)
        meta.decode_lens = torch.tensor(lens, dtype=torch.long, device=self.device)

    def execute(self, step: StepInput) -> torch.Tensor:
        return self.model.forward(step.input_ids, step.positions, step.meta, self.kv_caches, step.logits_indices)
