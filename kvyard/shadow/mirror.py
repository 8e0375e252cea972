"""Mirroring live traffic to a candidate deployment (`kvyard route --shadow URL`, #37).

The router sends a sampled share of the requests it serves (optionally only some routes and models) to the
candidate as well, fire-and-forget: a task of its own, started after the primary's request is placed, whose
answer no client ever sees. The primary's latency and errors do not depend on it:
- at most `max_in_flight` mirrored requests at once; past that a request is skipped (counted);
- a candidate that fails `dead_after` times in a row is skipped for `retry_after_s` (counted), then tried again;
- each mirrored request has its own timeout.
Each mirrored request is a Pair: the router reads the primary's answer into it as it relays it, the mirror the
candidate's; once both have ended the pair goes to the comparator (kvyard/shadow/live.py). The last `keep` pairs
are kept in memory.
"""

import asyncio
import logging
import random
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvyard.errors import ConfigError
from kvyard.net import sse_events
from kvyard.shadow.answers import AnswerReader
from kvyard.shadow.compare import Answer

log = logging.getLogger(__name__)


@dataclass
class ShadowSettings:
    url: str  # the candidate deployment (a kvyard server or router, or any OpenAI-compatible server)
    sample: float = 1.0  # the share of requests mirrored
    routes: list[str] = field(default_factory=list)  # e.g. ["/v1/chat/completions"]; empty: every route
    models: list[str] = field(default_factory=list)  # the request's "model"; empty: every model
    candidate_model: str | None = None  # the "model" the candidate is sent (None: the request's own)
    max_in_flight: int = 16
    timeout_s: float = 120.0
    dead_after: int = 3  # failures in a row before the candidate is skipped for a while
    retry_after_s: float = 10.0
    keep: int = 1024  # the last pairs kept in memory
    # The share of pairs teacher-forced on both sides for KL and top-1 (kvyard/shadow/live.py). Each costs a
    # prefill of the prompt and the answer on the primary's worker too: lower it where the primary is saturated.
    score: float = 1.0
    # Teacher-force the primary's side only while its worker has no client request in flight (waiting up to
    # timeout_s, else the pair is left unscored and counted): scoring then takes the primary's idle time only.
    score_when_idle: bool = True
    queue: int = 256  # pairs waiting to be scored; more are dropped (counted)
    record: str | None = None  # a JSON-lines file of the scored pairs, for `kvyard shadow report`
    redact: bool = False  # leave the prompts and the texts out of the record

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/").removesuffix("/v1")
        for name, ok in (("sample", 0.0 <= self.sample <= 1.0), ("score", 0.0 <= self.score <= 1.0),
                         ("max_in_flight", self.max_in_flight >= 1),
                         ("timeout_s", self.timeout_s > 0), ("dead_after", self.dead_after >= 1),
                         ("retry_after_s", self.retry_after_s >= 0), ("keep", self.keep >= 1),
                         ("queue", self.queue >= 1)):
            if not ok:
                raise ConfigError(f"shadow setting {name} is out of range: {getattr(self, name)!r}", param=name)


@dataclass
class Pair:
    """One mirrored request, and the primary's and the candidate's answers to it as they end."""

    request_id: str
    path: str
    body: dict[str, Any]
    arrived: float = field(default_factory=time.time)  # wall-clock time, for the record
    prompt_ids: list[int] | None = None  # as the router tokenized it
    served_by: str | None = None  # the primary's worker (it scores the primary's side)
    primary: Answer | None = None
    candidate: Answer | None = None
    errors: dict[str, str] = field(default_factory=dict)  # side -> why it has no answer
    pending: set[str] = field(default_factory=lambda: {"primary", "candidate"})
    on_done: Callable[["Pair"], None] | None = None

    def reader(self, side: str, started: float | None = None) -> AnswerReader:
        return AnswerReader(started, on_close=lambda r: self._ended(side, r))

    def _ended(self, side: str, reader: AnswerReader) -> None:
        answer = reader.answer()
        setattr(self, side, answer)
        if side == "primary":
            self.served_by = reader.served_by
        if answer is None:
            self.errors[side] = reader.failed or "the answer did not end"
        self.pending.discard(side)
        if not self.pending and self.on_done is not None:
            self.on_done(self)


class Mirror:
    def __init__(self, settings: ShadowSettings, client: httpx.AsyncClient, counter: Any = None,
                 on_pair: Callable[[Pair], None] | None = None):
        """`counter`: a prometheus Counter labelled by outcome (sent, ok, failed, skipped_busy, skipped_down,
        filtered). `on_pair`: called with each pair once both answers have ended (the comparator)."""
        self.settings = settings
        self.client = client
        self.counter = counter
        self.on_pair = on_pair
        self.in_flight = 0
        self.failures_in_a_row = 0
        self.down_until = 0.0
        self.pairs: deque[Pair] = deque(maxlen=settings.keep)
        self.tasks: set[asyncio.Task[None]] = set()
        self._random = random.Random()

    def offer(self, path: str, body: dict[str, Any]) -> Pair | None:
        """Mirror this request if it is sampled and the candidate can take it; never waits. The caller reads the
        primary's answer into the pair's primary reader."""
        s = self.settings
        if (s.routes and path not in s.routes) or (s.models and body.get("model") not in s.models):
            self._count("filtered")
            return None
        if s.sample < 1.0 and self._random.random() >= s.sample:
            return None
        if time.monotonic() < self.down_until:
            self._count("skipped_down")
            return None
        if self.in_flight >= s.max_in_flight:
            self._count("skipped_busy")
            return None
        self.in_flight += 1
        self._count("sent")
        pair = Pair(uuid.uuid4().hex, path, dict(body), on_done=self._paired)
        task = asyncio.create_task(self._send(pair))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return pair

    async def _send(self, pair: Pair) -> None:
        # Streamed whatever the client asked, so that its first token and the gaps are timed as the primary's are.
        body = {**pair.body, "stream": True}
        if self.settings.candidate_model is not None:
            body["model"] = self.settings.candidate_model
        body.pop("stream_options", None)
        reader = pair.reader("candidate")
        try:
            async with self.client.stream("POST", self.settings.url + pair.path, json=body,
                                          timeout=self.settings.timeout_s) as r:
                if r.status_code != 200:
                    reader.failed = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                else:
                    async for event in sse_events(r):
                        reader.event(event)
            if reader.answer() is None:
                raise ValueError(reader.failed or "the stream ended without [DONE]")
            self.failures_in_a_row = 0
            self._count("ok")
        except (httpx.HTTPError, ValueError) as e:
            reader.failed = reader.failed or f"{type(e).__name__}: {e}"
            self.failures_in_a_row += 1
            if self.failures_in_a_row >= self.settings.dead_after:
                self.down_until = time.monotonic() + self.settings.retry_after_s
                log.warning("shadow candidate %s failed %d times in a row (%s); skipped for %g s",
                            self.settings.url, self.failures_in_a_row, reader.failed, self.settings.retry_after_s)
            self._count("failed")
        finally:
            self.in_flight -= 1
            reader.close()

    def _paired(self, pair: Pair) -> None:
        self.pairs.append(pair)
        if self.on_pair is not None:
            self.on_pair(pair)

    def _count(self, outcome: str) -> None:
        if self.counter is not None:
            self.counter.labels(outcome).inc()

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

