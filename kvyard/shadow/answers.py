"""Reading one deployment's answer off the wire, as the comparator needs it (#37).

The router reads the primary's answer as it relays it to the client, and the mirror reads the candidate's the
same way, so both sides are measured alike: the text (or tool calls) of the first choice, the time to the first
generated token and the times between the later ones. Streamed answers (OpenAI server-sent events) and whole
JSON answers, of completions and of chat completions, are read.
"""

import json
import time
from collections.abc import Callable
from typing import Any

from kvyard.shadow.compare import Answer


class AnswerReader:
    def __init__(self, started: float | None = None, on_close: "Callable[[AnswerReader], None] | None" = None):
        self.started = time.monotonic() if started is None else started
        self.on_close = on_close  # called once, when the answer has ended or failed
        self.served_by: str | None = None  # the worker that answered, where a router relayed it
        self.text: list[str] = []
        self.calls: dict[int, dict[str, str]] = {}  # tool call index -> name and arguments so far
        self.ttft_s: float | None = None
        self.itl_s: list[float] = []
        self._last = 0.0
        self.failed: str | None = None
        self.ended = False  # a stream's [DONE] was read, or the whole answer

    def event(self, raw: bytes) -> None:
        """One server-sent event of a streamed answer (`data: {...}` and its blank line)."""
        for line in raw.decode(errors="replace").splitlines():
            if line.strip() == "data: [DONE]":
                self.ended = True
            if not line.startswith("data:") or self.ended:
                continue
            chunk = _json(line[5:])
            if not isinstance(chunk, dict):
                continue
            if "error" in chunk:
                self.failed = str(chunk["error"].get("message", chunk["error"]))
                continue
            for choice in chunk.get("choices") or []:
                if choice.get("index", 0) == 0:
                    self._delta(choice)

    def _delta(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta") or {}
        text = choice.get("text") if "text" in choice else delta.get("content")
        calls = delta.get("tool_calls") or []
        if not text and not calls:
            return
        now = time.monotonic()
        if self.ttft_s is None:
            self.ttft_s = now - self.started
        else:
            self.itl_s.append(now - self._last)
        self._last = now
        if text:
            self.text.append(text)
        for call in calls:
            seen = self.calls.setdefault(call.get("index", 0), {"name": "", "arguments": ""})
            fn = call.get("function") or {}
            seen["name"] += fn.get("name") or ""
            seen["arguments"] += fn.get("arguments") or ""

    def whole(self, content: bytes) -> None:
        """A non-streamed answer: the time to its first token is the time to all of it."""
        self.ttft_s = time.monotonic() - self.started
        self.ended = True
        answer = _json(content)
        try:
            choice = answer["choices"][0]
        except (TypeError, KeyError, IndexError):
            self.failed = f"no choices in the answer: {content[:200]!r}"
            return
        message = choice.get("message")
        self.text.append((message.get("content") if message else choice.get("text")) or "")
        for i, call in enumerate((message or {}).get("tool_calls") or []):
            fn = call.get("function") or {}
            self.calls[i] = {"name": fn.get("name") or "", "arguments": fn.get("arguments") or ""}

    def close(self) -> None:
        """Nothing more will be read (safe to call again)."""
        on_close, self.on_close = self.on_close, None
        if on_close is not None:
            on_close(self)

    def answer(self) -> Answer | None:
        """What was read, or None when the answer failed or did not end."""
        if self.failed is not None or not self.ended:
            return None
        calls = [self.calls[i] for i in sorted(self.calls)] or None
        return Answer("".join(self.text), self.ttft_s, self.itl_s, tool_calls=calls)


def _json(text: str | bytes) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
