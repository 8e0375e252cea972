"""Mirroring live traffic to a candidate deployment (`kvyard route --shadow-url URL`, #37).

The router sends a sampled share of the requests it serves (optionally only some routes and models) to the
candidate as well, fire-and-forget: a task of its own, started after the primary's request is placed, whose
answer no client ever sees. The primary's latency and errors do not depend on it:
- at most `max_in_flight` mirrored requests at once; past that a request is skipped (counted);
- a candidate that fails `dead_after` times in a row is skipped for `retry_after_s` (counted), then tried again;
- each mirrored request has its own timeout.
The candidate's answers (text, TTFT) are kept, the last `keep` of them, for the comparator.
"""

import asyncio
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvyard.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class ShadowSettings:
    url: str  # the candidate deployment (a kvyard server or router, or any OpenAI-compatible server)
    sample: float = 1.0  # the share of requests mirrored
    routes: list[str] = field(default_factory=list)  # e.g. ["/v1/chat/completions"]; empty: every route
    models: list[str] = field(default_factory=list)  # the request's "model"; empty: every model
    max_in_flight: int = 16
    timeout_s: float = 120.0
    dead_after: int = 3  # failures in a row before the candidate is skipped for a while
    retry_after_s: float = 10.0
    keep: int = 1024  # the candidate's answers kept for the comparator

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/").removesuffix("/v1")
        for name, ok in (("sample", 0.0 <= self.sample <= 1.0), ("max_in_flight", self.max_in_flight >= 1),
                         ("timeout_s", self.timeout_s > 0), ("dead_after", self.dead_after >= 1),
                         ("retry_after_s", self.retry_after_s >= 0), ("keep", self.keep >= 1)):
            if not ok:
                raise ConfigError(f"shadow setting {name} is out of range: {getattr(self, name)!r}", param=name)


@dataclass
class Mirrored:
    path: str
    body: dict[str, Any]
    text: str | None = None  # the candidate's answer (None: it failed)
    ttft_s: float | None = None
    error: str | None = None


class Mirror:
    def __init__(self, settings: ShadowSettings, client: httpx.AsyncClient, counter: Any = None):
        """`counter`: a prometheus Counter labelled by outcome (sent, ok, failed, skipped_busy, skipped_down,
        filtered)."""
        self.settings = settings
        self.client = client
        self.counter = counter
        self.in_flight = 0
        self.failures_in_a_row = 0
        self.down_until = 0.0
        self.answers: deque[Mirrored] = deque(maxlen=settings.keep)
        self.tasks: set[asyncio.Task[None]] = set()
        self._random = random.Random()

    def offer(self, path: str, body: dict[str, Any]) -> bool:
        """Mirror this request if it is sampled and the candidate can take it; never waits."""
        s = self.settings
        if (s.routes and path not in s.routes) or (s.models and body.get("model") not in s.models):
            self._count("filtered")
            return False
        if s.sample < 1.0 and self._random.random() >= s.sample:
            return False
        if time.monotonic() < self.down_until:
            self._count("skipped_down")
            return False
        if self.in_flight >= s.max_in_flight:
            self._count("skipped_busy")
            return False
        self.in_flight += 1
        self._count("sent")
        task = asyncio.create_task(self._send(path, dict(body)))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return True

    async def _send(self, path: str, body: dict[str, Any]) -> None:
        body["stream"] = False  # the whole answer at once: nobody watches the candidate's stream
        body.pop("stream_options", None)
        seen = Mirrored(path, body)
        started = time.monotonic()
        try:
            r = await self.client.post(self.settings.url + path, json=body, timeout=self.settings.timeout_s)
            r.raise_for_status()
            choice = r.json()["choices"][0]
            seen.text = choice["message"]["content"] if "message" in choice else choice["text"]
            seen.ttft_s = time.monotonic() - started  # unstreamed: the whole answer's time
            self.failures_in_a_row = 0
            self._count("ok")
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            seen.error = f"{type(e).__name__}: {e}"
            self.failures_in_a_row += 1
            if self.failures_in_a_row >= self.settings.dead_after:
                self.down_until = time.monotonic() + self.settings.retry_after_s
                log.warning("shadow candidate %s failed %d times in a row (%s); skipped for %g s",
                            self.settings.url, self.failures_in_a_row, seen.error, self.settings.retry_after_s)
            self._count("failed")
        finally:
            self.in_flight -= 1
            self.answers.append(seen)

    def _count(self, outcome: str) -> None:
        if self.counter is not None:
            self.counter.labels(outcome).inc()

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

