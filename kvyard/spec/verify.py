"""Verification of one request's drafts against the target's logits rows, one position at a time.

Row j holds the target's logits after [last token, draft 0 .. draft j-1]. Row j is processed only after
the tokens before it were emitted, so penalties, logit_bias, min_tokens and a grammar's bitmask
(process_logits) see exactly the state plain decoding would give them; a drafted token the grammar
forbids (or a -100 bias all but bans) has probability zero and is rejected. Greedy requests take the processed argmax and keep going while it
equals the draft, which makes greedy output identical to decoding without speculation; sampled
requests use rejection sampling, which keeps the output distribution (not the seeded sample path).
"""

from collections.abc import Callable, Sequence

import torch

from kvyard.engine.request import Request
from kvyard.engine.sampler import filter_logits, process_logits, sample, token_logprob
from kvyard.outputs import TokenLogprob
from kvyard.spec.rejection import rejection_sample

# Emits one token for a request (appending it, checking stops); returns True if the request finished.
Emit = Callable[[int, TokenLogprob | None], bool]


def choose(row: torch.Tensor, req: Request, draft: int | None) -> tuple[int, TokenLogprob | None]:
    """The token for one verified position ([1, vocab] row, modified in place)."""
    if draft is None or req.params.greedy:
        result = sample(row, [req])  # the bonus position, or greedy: exactly what plain decoding does
        return result.token_ids[0], result.logprobs[0]
    raw = row[0].log_softmax(-1) if req.params.logprobs is not None else None
    process_logits(row, [req])
    probs = filter_logits(row, [req])[0]
    token, _ = rejection_sample(probs, draft, req.generator)
    return token, None if raw is None else token_logprob(raw, token, req.params.logprobs or 0)


@torch.inference_mode()
def verify(req: Request, logits: torch.Tensor, drafts: Sequence[int], emit: Emit) -> int:
    """Emit the tokens `logits` ([len(drafts) + 1, vocab]) allow; return how many drafts were accepted.

    Stops at the first rejection (its replacement token is emitted), or when the request finishes;
    the bonus token is drawn from the last row when every draft was accepted.
    """
    for j in range(len(drafts) + 1):
        draft = drafts[j] if j < len(drafts) else None
        token, logprob = choose(logits[j : j + 1], req, draft)
        finished = emit(token, logprob)
        if draft is None or token != draft:
            return j
        if finished:
            return j + 1
    return len(drafts)
