"""Incremental detokenization with stop strings.

`tokenizers.decoders.DecodeStream` buffers tokens until they form whole UTF-8 characters, so text
never carries a broken character. Text that could be the start of a stop string is held back from
the stream until it is known not to be one.
"""

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens fed to the stream first, so the first generated token decodes in context
# (sentencepiece-style tokenizers drop a leading space otherwise).
_CONTEXT_TOKENS = 4


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.stream = DecodeStream(ids=prompt_ids[-_CONTEXT_TOKENS:], skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0  # characters of `text` already handed out
        self.stop_hit: str | None = None

    def add(self, token_id: int) -> None:
        """Feed one generated token; sets `stop_hit` and truncates the text if a stop string appears."""
        chunk = self.stream.step(self.tokenizer, token_id)
        if not chunk:
            return
        start = max(0, len(self.text) - self.hold)
        self.text += chunk
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) != -1]
        if hits:
            # The earliest stop string wins; like OpenAI, it is not part of the output.
            idx, self.stop_hit = min(hits)
            self.text = self.text[:idx]

    def take_delta(self, finished: bool) -> str:
        """Text that is safe to emit now: all of it once finished, else all but a possible stop prefix."""
        end = len(self.text) if finished or not self.stop else max(self.sent, len(self.text) - self.hold)
        delta = self.text[self.sent : end]
        self.sent = end
        return delta
