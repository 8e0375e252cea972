"""Reading tool calls out of generated text, whole or as it streams.

`parse_tool_calls(text, final)` splits text into content and `<tool_call>` blocks (kvyard/server/tools.py
describes the format). Streaming parses the text so far again on every increment and sends what is new
(`ToolCallStream`), so a streamed answer and a non-streamed one are read by the same code. While a
stream is open, text that may still turn out to be part of a tool call is held back: a trailing prefix
of `<tool_call>` in content, and the last characters of a call's arguments, which may be the `}` and
`</tool_call>` that close the block rather than arguments.

A call is never half-written in a response: `<tool_call>` text is never content, a block that
`max_tokens` cut short is dropped (the finish reason, `length`, says why), and a stream sends a call
(its name and whole arguments) once its block is closed, so every `arguments` string a client assembles
parses.
"""

import json
import re
import uuid
from dataclasses import dataclass, field

from kvyard.server.protocol import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta
from kvyard.server.tools import BEGIN, END

_HEADER = re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
# A call's arguments may be followed by this much before `</tool_call>` is complete: `}`, a little
# whitespace and all but the last character of the end tag. Streaming holds that much back.
_ARGS_HOLDBACK = 1 + 4 + len(END)


@dataclass
class ParsedCall:
    name: str
    arguments: str  # the arguments object as the model wrote it (so far, for an open call)
    complete: bool
    raw: str  # the whole block as generated


@dataclass
class ParsedOutput:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)

    @property
    def complete_calls(self) -> list[ParsedCall]:
        return [c for c in self.calls if c.complete]


def parse_tool_calls(text: str, final: bool = True) -> ParsedOutput:
    content: list[str] = []
    calls: list[ParsedCall] = []
    pos = 0
    while True:
        start = text.find(BEGIN, pos)
        if start < 0:
            tail = text[pos:]  # a trailing start of `<tool_call>` is held back, and dropped at the end
            content.append(tail[: len(tail) - _partial_suffix(tail, BEGIN)])
            break
        content.append(text[pos:start])
        head = _HEADER.match(text, start)
        if head is None:
            # Streaming: wait for the rest of the header. Final: a call cut inside its header, which
            # is not content either (only the tool grammar writes `<tool_call>`).
            break
        name = json.loads(head.group(1))
        end = text.find(END, head.end())
        if end < 0:
            rest = text[head.end() :]
            args = rest if final else rest[: max(0, len(rest) - _ARGS_HOLDBACK)]
            calls.append(ParsedCall(name, args, complete=False, raw=text[start:]))
            break
        body = text[head.end() : end].rstrip()
        args = body[:-1] if body.endswith("}") else body
        calls.append(ParsedCall(name, args, complete=_is_object(args), raw=text[start : end + len(END)]))
        pos = end + len(END)
    return ParsedOutput("".join(content), calls)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message_parts(text: str) -> tuple[str | None, list[ToolCall] | None]:
    """A finished answer as (content, tool_calls); a call cut short is dropped."""
    parsed = parse_tool_calls(text, final=True)
    content = parsed.content
    calls = [
        ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in parsed.complete_calls
    ]
    return (content.strip() or None) if calls else content, calls or None


@dataclass
class ToolCallStream:
    """Per streamed choice: what has been sent so far, and the next content and tool-call deltas."""

    sent_content: int = 0
    num_complete: int = 0  # calls sent: each in one delta, once its block closed

    def update(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        parsed = parse_tool_calls(text, final)
        content = parsed.content[self.sent_content :]
        self.sent_content = len(parsed.content)
        complete = parsed.complete_calls
        deltas = [
            ToolCallDelta(index=i, id=new_call_id(), type="function",
                          function=FunctionCallDelta(name=call.name, arguments=call.arguments))
            for i, call in enumerate(complete[self.num_complete :], start=self.num_complete)
        ]
        self.num_complete = len(complete)
        return content, deltas
