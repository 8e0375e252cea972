"""Detecting a generation that has fallen into a loop, one token at a time, in bounded work per token.

Two rules, each looking only at the tail of the output:

* token cycles: the last `size` tokens, for every size in [min_pattern_size, max_pattern_size], repeated
  `min_count` times in a row (size 1 is the same token N times). This is vLLM's `repetition_detection`.
  A cycle made only of "plain" tokens (whitespace, punctuation, digits, symbols: no letters) must cover
  at least `plain_min_tokens` tokens as well, because such runs are how legitimate text repeats itself:
  indentation, markdown table rules (`| --- | --- |`), `====` separators, `[0, 0, 0, 0]`, big numbers.
* text cycles (near-loops): the decoded text is cut into segments (lines, and sentences within them),
  each normalised (lowercase, list numbering and bullets removed, only letters and digits kept, so case,
  whitespace and punctuation changes do not matter), and a cycle of 1 to `text_max_period` segments
  repeated `text_min_count` times in a row trips. A cycle needs one segment with letters and either a
  list marker or at least `_MIN_SEGMENT_CHARS` characters, so closing braces, `end`, table rules and
  counting ("1. 1", "2. 2", where the numbers change anyway) never count.

Each rule keeps, per period p, the number of consecutive newest elements equal to the element p before
them; a pattern of size p occurs k times at the end exactly when that run reaches p * (k - 1). So every
new token costs O(max_pattern_size) comparisons, and every finished segment O(text_max_period).
"""

import re
import unicodedata
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

from tokenizers import Tokenizer

from kvyard.errors import InvalidRequestError

MAX_PATTERN_SIZE = 64  # cap on max_pattern_size: bounds the work per token
MAX_TEXT_PERIOD = 16
_MIN_SEGMENT_CHARS = 8  # normalised characters a segment needs to count without a list marker
_MAX_SEGMENT_CHARS = 512  # a "sentence" longer than this is cut, so the buffer stays bounded

# A segment ends at a newline, at sentence punctuation followed by whitespace, or at CJK sentence
# punctuation (which needs no space after it).
_BOUNDARY = re.compile(r"\n|[.!?](?=\s)|[。！？]")
# A whole segment that is only a list number ("14." was cut off "14. Honeybees" at its period).
_NUMBER_MARKER = re.compile(r"\s*(?:\d{1,4}|[a-zA-Z]|[ivxIVX]{1,5})[.)]\s*")
# A marker at the start of a line: "3) ", "- ", "* ", "• ", "> ".
_LEADING_MARKER = re.compile(r"\s*(?:\d{1,4}[.)]|[-*+•>])\s+")


@dataclass(frozen=True)
class RepetitionDetection:
    """What counts as a loop. The defaults are kvyard's; `from_vllm` gives vLLM's exact semantics."""

    min_count: int = 4  # occurrences in a row of a token cycle
    min_pattern_size: int = 1
    max_pattern_size: int = 16
    plain_min_tokens: int = 64  # tokens a cycle of letter-free tokens must cover; 0: no exception
    text_min_count: int = 3  # occurrences in a row of a normalised segment cycle; 0: no text rule
    text_max_period: int = 4  # segments in the longest text cycle

    @classmethod
    def from_vllm(cls, max_pattern_size: int = 0, min_pattern_size: int = 0,
                  min_count: int = 0) -> "RepetitionDetection | None":
        """vLLM's `repetition_detection` object: exact token n-grams only; max_pattern_size 0 disables it."""
        if max_pattern_size == 0:
            return None
        return cls(min_count=min_count, min_pattern_size=min_pattern_size or 1, max_pattern_size=max_pattern_size,
                   plain_min_tokens=0, text_min_count=0)

    @classmethod
    def from_dict(cls, values: dict[str, Any], where: str = "repetition_detection") -> "RepetitionDetection":
        known = {f.name for f in fields(cls)}
        for key in values:
            if key not in known:
                raise InvalidRequestError(f"{where}: unknown field {key!r}; known: {', '.join(sorted(known))}",
                                          param=f"{where}.{key}")
        made = cls(**values)
        made.validate(where)
        return made

    def validate(self, where: str = "repetition_detection") -> None:
        def whole(v: Any, lo: int, hi: int) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi

        checks = [
            ("min_count", whole(self.min_count, 2, 1024), "must be an integer in [2, 1024]"),
            ("min_pattern_size", whole(self.min_pattern_size, 1, MAX_PATTERN_SIZE),
             f"must be an integer in [1, {MAX_PATTERN_SIZE}]"),
            ("max_pattern_size", whole(self.max_pattern_size, 1, MAX_PATTERN_SIZE),
             f"must be an integer in [1, {MAX_PATTERN_SIZE}]"),
            ("plain_min_tokens", whole(self.plain_min_tokens, 0, 1 << 20), "must be an integer >= 0"),
            ("text_min_count", self.text_min_count == 0 or whole(self.text_min_count, 2, 1024),
             "must be 0 (off) or an integer in [2, 1024]"),
            ("text_max_period", whole(self.text_max_period, 1, MAX_TEXT_PERIOD),
             f"must be an integer in [1, {MAX_TEXT_PERIOD}]"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise InvalidRequestError(f"{where}.{name} {why}, got {getattr(self, name)!r}",
                                          param=f"{where}.{name}")
        if self.min_pattern_size > self.max_pattern_size:
            raise InvalidRequestError(
                f"{where}.min_pattern_size ({self.min_pattern_size}) must not exceed max_pattern_size "
                f"({self.max_pattern_size})", param=f"{where}.min_pattern_size")


@dataclass(frozen=True)
class Repetition:
    """What tripped: the rule ("tokens" or "text"), the cycle's length in its units, and how often it ran."""

    rule: str
    period: int
    count: int


def is_plain_text(text: str) -> bool:
    """Whitespace, punctuation, symbols and digits only. U+FFFD (part of a character) is not plain."""
    return bool(text) and all(
        ch.isspace() or (ch != "\ufffd" and unicodedata.category(ch)[0] in "PSN") for ch in text
    )


class _PeriodRuns:
    """For each period p in [lo, hi]: how many newest elements in a row equal the one p before them."""

    def __init__(self, lo: int, hi: int, keep: int = 0):
        self.lo = lo
        self.tail: deque[Any] = deque(maxlen=max(hi + 1, keep))
        self.runs = [0] * (hi + 1)

    def push(self, item: Any) -> None:
        tail, runs = self.tail, self.runs
        tail.append(item)
        n = len(tail)
        for p in range(self.lo, len(runs)):
            runs[p] = runs[p] + 1 if p < n and tail[n - 1 - p] == item else 0

    def count(self, p: int) -> int:
        """Occurrences in a row, at the end, of the last p elements."""
        return self.runs[p] // p + 1


class RepetitionDetector:
    """Per-request state; feed every generated token with the request's decoded text so far."""

    def __init__(self, settings: RepetitionDetection, tokenizer: Tokenizer | None = None):
        """`tokenizer` decodes cycles for the plain-token exception; without one every cycle counts."""
        self.settings = settings
        self._tokenizer = tokenizer
        # Two cycles' worth of tokens are kept: enough to decode a whole cycle whatever its rotation.
        self._tokens = _PeriodRuns(settings.min_pattern_size, settings.max_pattern_size,
                                   keep=2 * settings.max_pattern_size)
        self._text = _TextCycles(settings.text_min_count, settings.text_max_period) if settings.text_min_count else None
        self._consumed = 0  # characters of the decoded text already fed to the text rule
        self.found: Repetition | None = None

    def add(self, token_id: int, text: str | None = None) -> Repetition | None:
        """Feed one token (and the full decoded output text, if the text rule is on); the loop found, if any."""
        hit = self._add_token(token_id)
        if self._text is not None and text is not None:
            if len(text) < self._consumed:  # the text was cut (a stop string): start over from there
                self._consumed = len(text)
            new, self._consumed = text[self._consumed :], len(text)
            hit = self._text.add(new) or hit
        if hit is not None and self.found is None:
            self.found = hit
        return hit

    def _add_token(self, token_id: int) -> Repetition | None:
        s, cycles = self.settings, self._tokens
        cycles.push(token_id)
        for p in range(s.min_pattern_size, s.max_pattern_size + 1):
            if cycles.runs[p] < p * (s.min_count - 1):
                continue
            span = cycles.runs[p] + p  # tokens covered by the repeats, the newest partial one included
            if s.plain_min_tokens and span < s.plain_min_tokens and self._is_plain(p):
                continue  # a letter-free cycle: legitimate until it covers plain_min_tokens tokens
            return Repetition("tokens", p, cycles.count(p))
        return None

    def _is_plain(self, p: int) -> bool:
        """Whether the cycle of size p at the end decodes to letter-free text.

        Decoded two cycles at a time: a cycle may start inside a character whose bytes are several
        tokens, and the broken ends (U+FFFD) are dropped; what is left is whole characters.
        """
        if self._tokenizer is None:
            return False
        tail = self._tokens.tail
        n = min(len(tail), 2 * p)
        text = self._tokenizer.decode([tail[i] for i in range(len(tail) - n, len(tail))], skip_special_tokens=False)
        return is_plain_text(text.strip("\ufffd"))


class _TextCycles:
    """Cuts decoded text into normalised segments and finds cycles of them."""

    def __init__(self, min_count: int, max_period: int):
        self.min_count = min_count
        self._keys = _PeriodRuns(1, max_period)
        self._qualifies: deque[bool] = deque(maxlen=max_period)
        self._buffer = ""
        self._line_start = True  # the buffer begins a line (a list marker may follow)
        self._marked = False  # the current segment followed a list marker

    def add(self, new_text: str) -> Repetition | None:
        if not new_text:
            return None
        # Only the new text can hold a boundary, or the last old character once its lookahead arrives.
        scan_from = max(0, len(self._buffer) - 1)
        self._buffer += new_text
        hit = None
        while True:
            m = _BOUNDARY.search(self._buffer, scan_from)
            scan_from = 0
            if m is None:
                if len(self._buffer) > _MAX_SEGMENT_CHARS:
                    hit = self._segment(self._buffer, line_end=False) or hit
                    self._buffer = ""
                return hit
            end = m.end()
            hit = self._segment(self._buffer[:end], line_end=m.group() == "\n") or hit
            self._buffer = self._buffer[end:]

    def _segment(self, raw: str, line_end: bool) -> Repetition | None:
        at_line_start, self._line_start = self._line_start, line_end
        if at_line_start and _NUMBER_MARKER.fullmatch(raw.rstrip("\n")):
            self._marked = True  # "14." of "14. Honeybees": the item follows
            self._line_start = False
            return None
        marked, self._marked = self._marked, False
        if at_line_start and (m := _LEADING_MARKER.match(raw)):
            raw, marked = raw[m.end() :], True
        key = "".join(ch for ch in raw.lower() if ch.isalnum())
        if not key:
            return None  # blank lines, rules, fences: neither part of a cycle nor a break in one
        qualifies = any(ch.isalpha() for ch in key) and (marked or len(key) >= _MIN_SEGMENT_CHARS)
        self._keys.push(key)
        self._qualifies.append(qualifies)
        for p in range(1, len(self._keys.runs)):
            if self._keys.runs[p] >= p * (self.min_count - 1) and any(list(self._qualifies)[-p:]):
                return Repetition("text", p, self._keys.count(p))
        return None
