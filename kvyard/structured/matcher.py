"""One request's position in its grammar: which tokens may come next, and what the sampled ones did.

`GrammarState` wraps an xgrammar `GrammarMatcher` (a pushdown automaton over the compiled grammar).
The engine owns one per constrained request, on the engine thread:

1. before sampling, `fill(bitmask, row)` writes the allowed-token bitmask into the batch's mask row;
2. after sampling, `accept(token)` advances the state; a token the grammar rejects never happens in
   normal decoding (it was masked), so a rejection is a bug and the engine fails the request;
3. `terminated` becomes true once the grammar has accepted a stop token after a complete match: the
   request finishes with finish_reason "stop".

Speculative decoding (kvyard/spec/) verifies a request's drafts one position at a time and advances
the matcher only for tokens it emits, so each position is masked exactly as plain decoding would mask
it: a drafted token the grammar forbids has probability zero and is rejected, and nothing needs
undoing. `rollback(n)` is there for a verifier that runs ahead instead (accept k drafted tokens to
fill the masks of all k positions at once, then roll back the k - j that verification rejects).
xgrammar keeps the whole history, so any number of accepted tokens can be rolled back.
"""

import torch
import xgrammar as xgr

from kvyard.structured.closing import BudgetCloser, closing_steps


class GrammarState:
    def __init__(self, compiled: xgr.CompiledGrammar):
        self._matcher = xgr.GrammarMatcher(compiled)
        self._closer = BudgetCloser(self._matcher, compiled.tokenizer_info)
        self.num_accepted = 0

    def tokens_to_close(self, limit: int) -> int | None:
        """Tokens kvyard's closing path takes to a complete match from here (kvyard/structured/closing.py);
        None when it takes more than `limit`."""
        return closing_steps(self._matcher, self._closer.info, limit)

    def steer(self, row: torch.Tensor, tokens_left: int) -> None:
        """Near the end of the budget, keep only tokens after which the grammar can still complete in time."""
        self._closer.restrict(row, tokens_left)

    @property
    def budget_forced(self) -> bool:
        """The budget changed what the model could write (the request then finishes with "length")."""
        return self._closer.forced

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (one bit per token id)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False (and no change) if the grammar does not allow it."""
        ok = self._matcher.accept_token(token_id)
        if ok:
            self.num_accepted += 1
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (for speculative decoding; see the module doc)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} accepted tokens")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: generation is over."""
        return self._matcher.is_terminated()

    @property
    def completed(self) -> bool:
        """The text so far is a complete match (a stop token may come next)."""
        return self._matcher.is_completed()
