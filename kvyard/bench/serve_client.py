"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

Timing is taken where the client sees the bytes: TTFT is the arrival of the first chunk with
content (kvyard and vLLM open a chat stream with an empty role-only chunk, which is not a token), ITL
the gaps between content chunks. The output length comes from the streamed `usage` when the server
sends it (`stream_options.include_usage`). llama-cpp-python's server does not; there a stream that
ended with finish_reason "length" produced max_tokens tokens (that is what "length" means), and
otherwise the content chunks are counted, one token each except where the server held back half a
UTF-8 character and sent two tokens in one chunk (`token_source` says which rule gave the count).
"""

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class RequestResult:
    ok: bool
    start: float  # seconds after the run started
    expected_output_tokens: int
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    chunks: int = 0  # content chunks received
    prompt_tokens: int | None = None  # from usage; None when the server did not say
    token_source: str | None = None  # "usage", "finish_length" or "chunks"
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; undefined for one-token outputs."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def _piece(choice: dict[str, Any]) -> str:
    """The generated text in one streamed choice: completions' `text`, chat's `delta` (content or tool calls)."""
    if isinstance(choice.get("text"), str):
        return choice["text"]
    delta = choice.get("delta") or {}
    text = delta.get("content") or ""
    for call in delta.get("tool_calls") or []:
        fn = call.get("function") or {}
        text += (fn.get("name") or "") + (fn.get("arguments") or "")
    return text


async def stream_request(client: httpx.AsyncClient, path: str, body: dict[str, Any], timeout: float,
                         run_start: float, expected_output_tokens: int) -> RequestResult:
    """POST `body` with stream=true and read the event stream; never raises, never outlives `timeout`."""
    t0 = time.perf_counter()
    res = RequestResult(ok=False, start=t0 - run_start, expected_output_tokens=expected_output_tokens)
    chunks = 0
    last: float | None = None
    done = False
    usage_tokens: int | None = None
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    detail = (await r.aread()).decode("utf-8", "replace")[:300]
                    res.error = f"HTTP {r.status_code}: {detail}"
                    return res
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, `: ping` comments
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if not isinstance(event, dict):
                        res.error = f"not an event object: {data[:100]}"
                        return res
                    if "error" in event:
                        res.error = f"error event: {json.dumps(event['error'])[:300]}"
                        return res
                    if event.get("usage"):
                        usage_tokens = event["usage"].get("completion_tokens")
                        res.prompt_tokens = event["usage"].get("prompt_tokens")
                    for choice in event.get("choices") or []:
                        res.finish_reason = choice.get("finish_reason") or res.finish_reason
                    piece = "".join(_piece(c) for c in event.get("choices") or [])
                    if not piece:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itls.append(now - last)
                    last = now
                    chunks += 1
                    res.text += piece
    except TimeoutError:
        res.error = f"timeout after {timeout:g} s"
        return res
    except (httpx.HTTPError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
        res.error = f"{type(e).__name__}: {e}"[:300]
        return res
    res.e2e = time.perf_counter() - t0
    res.chunks = chunks
    if not done:
        res.error = "the stream ended without [DONE]"
    elif chunks == 0:
        res.error = "no output"
    else:
        res.ok = True
    if usage_tokens is not None:
        res.output_tokens, res.token_source = usage_tokens, "usage"
    elif res.finish_reason == "length" and chunks <= expected_output_tokens:
        res.output_tokens, res.token_source = expected_output_tokens, "finish_length"
    else:
        res.output_tokens, res.token_source = chunks, "chunks"
    return res
