"""Soft tokens: prompt positions whose input embeddings are given rather than looked up (a grafted image's).

The prompt holds placeholder ids at those positions, so lengths, positions and block tables work as for any
prompt. The embeddings replace the placeholders' rows after the embedding lookup (`ModelRunner` gathers the
rows of a step's chunk, the model writes them). Their content digest enters the prefix-cache key of every
block they overlap (`block_salt`), and through the hash chain every block after: two prompts with the same
text and different images never share KV past the image, while the blocks before it and identical images do.
A prompt without soft tokens hashes exactly as before.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvyard.errors import InvalidRequestError


@dataclass(frozen=True, eq=False)
class SoftTokens:
    start: int  # the first placeholder position in the prompt
    embeds: torch.Tensor  # [count, hidden]: the rows that replace the placeholders' embeddings
    digest: bytes  # the content hash of what they encode (an image's sha256): their identity in the cache

    @property
    def end(self) -> int:
        return self.start + len(self.embeds)


def block_salt(spans: Sequence[SoftTokens], salt: bytes, block_size: int, index: int) -> bytes:
    """Block `index`'s cache salt: the request's, followed by the digests of the soft tokens it overlaps."""
    lo, hi = index * block_size, (index + 1) * block_size
    return salt + b"".join(s.digest for s in spans if s.start < hi and s.end > lo)


def check_spans(spans: Sequence[SoftTokens], num_prompt_tokens: int, hidden: int) -> None:
    """Raise InvalidRequestError unless the spans lie inside the prompt, apart, with rows of the model's width."""
    last = 0
    for span in sorted(spans, key=lambda s: s.start):
        if span.embeds.dim() != 2 or span.embeds.shape[1] != hidden:
            raise InvalidRequestError(f"soft tokens must be [count, {hidden}], got {tuple(span.embeds.shape)}",
                                      param="messages")
        if span.start < last or span.end > num_prompt_tokens:
            raise InvalidRequestError(f"soft tokens at {span.start}..{span.end} overlap another span or leave the "
                                      f"prompt of {num_prompt_tokens} tokens", param="messages")
        last = span.end


def chunk_rows(spans: Sequence[SoftTokens], start: int, n: int, row: int) -> list[tuple[int, torch.Tensor]]:
    """For a chunk of positions [start, start + n) placed at step row `row`: (first row, embeddings) of every
    piece of a span inside it."""
    pieces = []
    for span in spans:
        lo, hi = max(start, span.start), min(start + n, span.end)
        if lo < hi:
            pieces.append((row + lo - start, span.embeds[lo - span.start : hi - span.start]))
    return pieces


def step_embeds(pieces: list[tuple[int, torch.Tensor]], device: torch.device | str = "cpu"
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A step's pieces as (row indices, rows), or None when the step has none."""
    if not pieces:
        return None
    rows = torch.cat([torch.arange(r, r + len(e)) for r, e in pieces])
    return rows.to(device), torch.cat([e for _, e in pieces]).to(device)
