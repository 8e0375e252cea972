"""Turns a scheduled batch into the flat tensors one forward pass needs, and runs it."""

from dataclasses import dataclass, field

import torch

from kvyard.engine.request import Request
from kvyard.engine.scheduler import ScheduledBatch
from kvyard.models.attention import AttentionMetadata, PrefillSpan, causal_context_mask
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


class ModelRunner:
    def __init__(self, model: DecoderModel, kv_caches: list[LayerKV], block_size: int):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = model.device

    def _slots(self, req: Request, start: int, end: int) -> list[int]:
        bs, table = self.block_size, req.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(self, batch: ScheduledBatch) -> StepInput:
        pairs = list(zip(batch.requests, batch.num_new_tokens, strict=True))
        # Decodes first so that they form one contiguous group for batched attention.
        pairs.sort(key=lambda rn: rn[1] != 1)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampled: list[Request] = []
        num_rows: list[int] = []
        prompt_rows: list[tuple[Request, int, int]] = []
        prompt_indices: list[int] = []
        decodes = [r for r, n in pairs if n == 1]
        prefills: list[PrefillSpan] = []
        for req, n in pairs:
            start = req.num_computed_tokens
            row = len(ids)
            # Drafts to verify follow the request's last token: a short chunk over its cached context,
            # so it takes the prefill path (context slots + causal mask) and gets a row per position.
            k = len(req.spec_token_ids)
            tokens = req.token_ids + req.spec_token_ids if k else req.token_ids
            ids.extend(tokens[start : start + n])
            pos.extend(range(start, start + n))
            slots.extend(self._slots(req, start, start + n))
            if n > 1:
                prefills.append(self._prefill_span(req, row, n))
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
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, device=dev), block_size=self.block_size,
                                 prefills=prefills)
        if decodes:
            self._decode_metadata(decodes, meta)
        return StepInput(
            input_ids=torch.tensor(ids, device=dev),
            positions=torch.tensor(pos, device=dev),
            meta=meta,
            logits_indices=torch.tensor(logits_rows + prompt_indices, device=dev, dtype=torch.long),
            sampled=sampled,
            num_rows=num_rows,
            prompt_rows=prompt_rows,
        )

    def _prefill_span(self, req: Request, row: int, n: int) -> PrefillSpan:
        start = req.num_computed_tokens
        if start == 0:
            return PrefillSpan(row, row + n, None, None)
        ctx = start + n
        return PrefillSpan(
            row,
            row + n,
            torch.tensor(self._slots(req, 0, ctx), device=self.device),
            causal_context_mask(n, ctx, self.device),
        )

    def _decode_metadata(self, decodes: list[Request], meta: AttentionMetadata) -> None:
        lens = [r.num_computed_tokens + 1 for r in decodes]
        nblocks = -(-max(lens) // self.block_size)
        # One tensor from padded lists: a tensor per request costs more than the whole table at 32 rows.
        rows = [r.block_table[:nblocks] for r in decodes]
        table = torch.tensor([t + [0] * (nblocks - len(t)) for t in rows], dtype=torch.long)
        meta.num_decodes = len(decodes)
        meta.decode_blocks = table.to(self.device)
        meta.decode_lens = torch.tensor(lens, dtype=torch.long, device=self.device)

    def execute(self, step: StepInput) -> torch.Tensor:
        return self.model.forward(step.input_ids, step.positions, step.meta, self.kv_caches, step.logits_indices)
