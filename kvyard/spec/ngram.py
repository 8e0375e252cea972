"""Prompt-lookup drafting: the tokens that followed the latest earlier occurrence of the context's tail.

No model runs: when the output copies the prompt (edits, rewrites, code that repeats names), the last
n tokens have appeared before, and what followed them then is a good guess for what follows now.
"""

from collections.abc import Mapping, Sequence

import numpy as np

from kvyard.engine.request import Request
from kvyard.spec.proposer import Proposer


def lookup(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Match the last n tokens (n from max_n down to min_n) earlier in `tokens`; return the next k."""
    arr = np.asarray(tokens, dtype=np.int64)
    size = arr.shape[0]
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        tail = arr[size - n :]
        # Windows that end before the tail's last token, so every match has a continuation.
        windows = np.lib.stride_tricks.sliding_window_view(arr[: size - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            # The latest match is the most relevant one, but one right before the tail (a loop) has a
            # short continuation: prefer the latest match that continues for k tokens.
            full = hits[hits + n + k <= size]
            start = int(full[-1] if full.size else hits[0]) + n
            return arr[start : start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.min_n = max(1, min_n)
        self.max_n = max(self.min_n, max_n)

    def propose(self, requests: Sequence[Request], num_tokens: Mapping[str, int]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for req in requests:
            k = num_tokens.get(req.request_id, 0)
            if k > 0:
                draft = lookup(req.token_ids, self.min_n, self.max_n, k)
                if draft:
                    out[req.request_id] = draft
        return out


class LookupFirst:
    """Prompt lookup for the requests whose context repeats itself, another drafter for the rest.

    A lookup hit costs no forward pass and, where the output copies (a repeated phrase, a loop, a quoted
    name), it is right more often than a small model; the model drafts where lookup finds nothing.
    """

    def __init__(self, lookup: NgramProposer, fallback: Proposer):
        self.lookup = lookup
        self.fallback = fallback

    def propose(self, requests: Sequence[Request], num_tokens: Mapping[str, int]) -> dict[str, list[int]]:
        out = self.lookup.propose(requests, num_tokens)
        rest = [r for r in requests if r.request_id not in out]
        if rest:
            out.update(self.fallback.propose(rest, num_tokens))
        return out
