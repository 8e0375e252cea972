"""Finishing a constrained output within its token budget, so that `max_tokens` never cuts a JSON answer or a
tool call in half.

`closing_steps(matcher)` counts the tokens of one way to complete the grammar from the matcher's state: take
the forced continuation whole when there is one (xgrammar's jump-forward tokens), else a closing character
that completes the match at once, else the first of a fixed list of one-character tokens the grammar
allows: closers first (`"`, `}`, `]`), then the shortest values (`0`, digits), separators, then letters
(enums and literals). It runs on a fork, so the request's state is untouched. It is an upper bound on the fewest tokens that complete the grammar, which is what a guarantee
needs: a state whose count fits the budget can always be completed in time by following that path.

Near the end of the budget (`BudgetCloser.restrict`), the sampler keeps only tokens after which the count
still fits what is left: the most likely allowed tokens that do, or else the path's own next token. So
the model writes freely while there is room and is steered to close as the budget runs out. No public
engine does this; vLLM and SGLang return the cut JSON.
"""

import string
from dataclasses import dataclass

import torch
import xgrammar as xgr

# One-character tokens the closing path may take, in order of preference: closers, the shortest values,
# then every other printable character (letters for enums and literals, `>` of an end tag, spaces).
_PREFERRED = '"}])>0123456789,: tfn'
_PATH_CHARS = _PREFERRED + "".join(c for c in string.printable if c not in _PREFERRED and c not in "\t\r\x0b\x0c")
# While this many tokens or more are left beyond the closing path's count, sampling is not restricted.
# A single token can lengthen the path (opening an object whose properties are required), by up to this.
FREE_MARGIN = 24
# Beyond this many tokens left, no step is restricted and the path is not even counted: it costs a fork and
# a walk per step, and no schema's closing path here comes near it.
STEER_WITHIN = 128
CANDIDATES = 16  # most likely allowed tokens checked at each restricted step
FORCED_MASS = 1e-3  # a restriction that removes more probability than this forced the close
_CLOSERS = '"}])>'  # tried first where one completes the match


@dataclass(frozen=True)
class _Path:
    closers: tuple[int, ...]  # tokens of _CLOSERS
    tokens: tuple[int, ...]  # tokens of _PATH_CHARS, in order


_PATHS: dict[tuple[int, str], _Path] = {}


def _path_tokens(info: xgr.TokenizerInfo) -> _Path:
    """The one-character tokens of the closing path (characters without a token of their own are left out).
    Kept per tokenizer: xgrammar gives a new TokenizerInfo object each time, so it is keyed by what
    describes it."""
    key = (info.vocab_size, info.dump_metadata())
    if key not in _PATHS:
        by_text: dict[bytes, int] = {}
        for i, text in enumerate(info.decoded_vocab):
            if len(text) == 1 and text not in by_text:
                by_text[text] = i
        pick = lambda chars: tuple(by_text[c.encode()] for c in chars if c.encode() in by_text)  # noqa: E731
        _PATHS[key] = _Path(pick(_CLOSERS), pick(_PATH_CHARS))
    return _PATHS[key]


def _step(m: xgr.GrammarMatcher, path: _Path) -> list[int] | None:
    """Advance `m` by one move of the closing path; the tokens it took, or None when nothing fits."""
    jump = m.find_jump_forward_tokens()
    if jump and all(m.accept_token(t) for t in jump):
        return jump
    for t in path.closers:  # a closer that completes the match: `{` + `}`, not `{` + `"": ""` + `}`
        if m.accept_token(t):
            if m.is_completed():
                return [t]
            m.rollback(1)
    for t in path.tokens:
        if m.accept_token(t):
            return [t]
    return None


def closing_steps(matcher: xgr.GrammarMatcher, info: xgr.TokenizerInfo, limit: int) -> int | None:
    """Tokens the closing path takes from `matcher`'s state to a complete match; None past `limit`."""
    m = matcher.fork()
    path = _path_tokens(info)
    n = 0
    while not m.is_completed():
        took = _step(m, path)
        if took is None or n + len(took) > limit:
            return None
        n += len(took)
    return n


def next_path_token(matcher: xgr.GrammarMatcher, info: xgr.TokenizerInfo) -> int | None:
    """The first token of the closing path from `matcher`'s state."""
    took = _step(matcher.fork(), _path_tokens(info))
    return took[0] if took else None


@dataclass
class BudgetCloser:
    """One constrained request's steering; `restrict` is called on its (already grammar-masked) logits row."""

    matcher: xgr.GrammarMatcher
    info: xgr.TokenizerInfo
    forced: bool = False  # a restriction took away more than FORCED_MASS of a step's probability

    def restrict(self, row: torch.Tensor, left: int) -> None:
        """Mask `row` to tokens after which the grammar can still complete within `left - 1` tokens."""
        if left <= 0 or left > STEER_WITHIN:
            return
        # A complete match may still go on (a second tool call, more digits): it is steered the same way.
        need = closing_steps(self.matcher, self.info, left + FREE_MARGIN)
        if need is None or need + FREE_MARGIN < left:
            return  # room to spare (or no path found: nothing safer to do than leave the grammar's mask)
        keep = [t for t in self._likely(row) if self._fits_after(t, left - 1)]
        if not keep:
            token = next_path_token(self.matcher, self.info)
            keep = [token] if token is not None else []
        if keep:
            # It forced the close when what it took away mattered: more than FORCED_MASS of the probability.
            self.forced |= float(torch.softmax(row.float(), -1)[keep].sum()) < 1.0 - FORCED_MASS
            allowed = row[keep].clone()
            row.fill_(float("-inf"))
            row[keep] = allowed

    def _likely(self, row: torch.Tensor) -> list[int]:
        finite = torch.isfinite(row)
        k = min(CANDIDATES, int(finite.sum()))
        return row.topk(k).indices.tolist() if k else []

    def _fits_after(self, token: int, left: int) -> bool:
        m = self.matcher.fork()
        if not m.accept_token(token):
            return False
        if m.is_completed():
            return True
        need = closing_steps(m, self.info, left)
        return need is not None and need <= left
