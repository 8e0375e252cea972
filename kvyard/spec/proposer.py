"""The drafter interface: given requests and how many tokens each may draft, propose the next tokens."""

from collections.abc import Mapping, Sequence
from typing import Protocol

from kvyard.engine.request import Request


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], num_tokens: Mapping[str, int]) -> dict[str, list[int]]:
        """Draft up to `num_tokens[request_id]` tokens to follow each request's `token_ids`.

        Proposals are deterministic (a point mass for rejection sampling). A request may get fewer
        tokens than asked, or none; requests missing from the result draft nothing this step.
        """
        ...
