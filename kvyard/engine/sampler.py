"""Batched sampling where every row carries its own parameters.

Order of operations: raw logprobs (reported as the model's own distribution), then penalties, the
min_tokens mask, the grammar bitmask of constrained rows (kvyard/structured/bitmask.py), and finally
greedy argmax or temperature/top-k/top-p/min-p sampling. Random rows draw from their request's own
generator, so a seed reproduces the same tokens whatever the batch.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvyard.engine.request import Request
from kvyard.outputs import TokenLogprob

_ARGMAX_CHUNK = 1024


def fast_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first index on ties) in two passes of vectorised max.

    torch's CPU argmax over a 50k-150k vocabulary runs one scalar loop per row (about 2 ms for 32
    rows); a max over chunks, then an argmax inside the winning chunk, gives the same index.
    """
    rows, vocab = logits.shape
    if logits.device.type != "cpu" or vocab <= _ARGMAX_CHUNK or rows == 0:
        return logits.argmax(-1)
    pad = -vocab % _ARGMAX_CHUNK
    padded = F.pad(logits, (0, pad), value=float("-inf")) if pad else logits
    chunks = padded.view(rows, -1, _ARGMAX_CHUNK)
    best_chunk = chunks.amax(-1).argmax(-1)
    inside = chunks[torch.arange(rows), best_chunk].argmax(-1)
    return best_chunk * _ARGMAX_CHUNK + inside


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> None:
    rows = [
        i
        for i, r in enumerate(reqs)
        if r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty
    ]
    for i in rows:
        p = reqs[i].params
        row = logits[i]
        if p.repetition_penalty != 1.0:
            # HF semantics: every token seen in prompt or output is made less likely.
            seen = torch.tensor(sorted(set(reqs[i].token_ids)), dtype=torch.long, device=row.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        out = reqs[i].output_token_ids
        if out and (p.presence_penalty or p.frequency_penalty):
            # OpenAI semantics: only generated tokens count.
            out_ids = torch.tensor(out, dtype=torch.long, device=row.device)
            counts = torch.bincount(out_ids, minlength=row.shape[0]).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def apply_min_tokens(logits: torch.Tensor, reqs: list[Request]) -> None:
    for i, r in enumerate(reqs):
        # A grammar decides alone when its output may end: banning its stop token could leave nothing allowed.
        if r.num_output_tokens < r.params.min_tokens and r.grammar is None:
            banned = list(r.params.stop_token_ids) + ([] if r.params.ignore_eos else list(r.eos_token_ids))
            if banned:
                logits[i, banned] = float("-inf")


def filter_logits(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on the rows that sample; returns probabilities."""
    dev = logits.device
    temps = torch.tensor([r.params.temperature for r in reqs], dtype=logits.dtype, device=dev).unsqueeze(1)
    logits = logits / temps
    top_k = [r.params.top_k for r in reqs]
    top_p = [r.params.top_p for r in reqs]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        k = torch.tensor([k if k > 0 else vocab for k in top_k], device=dev).unsqueeze(1)
        ranks = torch.arange(vocab, device=dev).unsqueeze(0)
        drop = ranks >= k
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        before = probs.cumsum(-1) - probs
        drop |= before >= torch.tensor(top_p, dtype=logits.dtype, device=dev).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    probs = logits.softmax(-1)
    min_p = torch.tensor([r.params.min_p for r in reqs], dtype=probs.dtype, device=dev).unsqueeze(1)
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, 0.0)
    return probs


@torch.inference_mode()
def sample(logits: torch.Tensor, reqs: list[Request]) -> SampleResult:
    logprob_rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    raw_logprobs = logits[logprob_rows].log_softmax(-1) if logprob_rows else None
    process_logits(logits, reqs)
    tokens = fast_argmax(logits)
    random_rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
    if random_rows:
        sub = [reqs[i] for i in random_rows]
        probs = filter_logits(logits[random_rows], sub)
        for j, (i, r) in enumerate(zip(random_rows, sub, strict=True)):
            # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, using this request's generator.
            # Drawn on the CPU, where the request's generator lives, whatever the model's device.
            noise = torch.empty(probs.shape[1]).exponential_(generator=r.generator).to(probs.device)
            tokens[i] = (probs[j] / noise).argmax()
    token_list = tokens.tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(reqs)
    for j, i in enumerate(logprob_rows):
        logprobs[i] = token_logprob(raw_logprobs[j], token_list[i], reqs[i].params.logprobs or 0)
    return SampleResult(token_list, logprobs)


def process_logits(logits: torch.Tensor, reqs: list[Request]) -> None:
    """Everything between the model's logits and the choice, in place: penalties, min_tokens, grammar.

    Speculative verification (kvyard/spec/verify.py) runs this too, on each verified position's row.
    """
    apply_penalties(logits, reqs)
    apply_min_tokens(logits, reqs)
    if any(r.grammar is not None for r in reqs):
        from kvyard.structured.bitmask import apply_grammar_bitmask  # lazily: xgrammar only when used

        apply_grammar_bitmask(logits, [r.grammar for r in reqs])


def token_logprob(row: torch.Tensor, token: int, n: int) -> TokenLogprob:
    """The chosen token's logprob and the top-n alternatives, from one row of raw logprobs."""
    top_vals, top_ids = row.topk(n) if n else (row[:0], row[:0].long())
    return TokenLogprob(
        token_id=token,
        logprob=float(row[token]),
        top=dict(zip(top_ids.tolist(), top_vals.tolist(), strict=True)),
    )
