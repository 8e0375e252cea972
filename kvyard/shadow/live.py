"""Comparing the primary with the candidate on live mirrored traffic, in the router (#37).

Each pair whose two answers have ended (kvyard/shadow/mirror.py) is scored off the serving path: one background
task reads a bounded queue, and a pair that finds it full is dropped and counted, never waited for. Scoring:
- the texts, JSON validity, tool calls and latencies straight from the two answers;
- for a `score` share of the pairs, the teacher-forced KL and top-1 agreement: the primary's text is tokenized as the router
  tokenizes prompts, and both the worker that served it and the candidate return their distributions at each of
  its tokens (kvyard/shadow/score.py). That is one extra prefill on each side per pair; with `score_when_idle`
  the primary's is sent only while its worker has no client request in flight.
Results go to the router's /metrics (kvyard_shadow_*) and, with `record` set, one JSON line per pair for
`kvyard shadow report`; `redact` leaves the prompts and texts out of the file.
"""

import asyncio
import json
import logging
import random
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvyard.background import BoundedWorker
from kvyard.shadow.compare import Answer, Budgets, PairScore, score_pair, verdict
from kvyard.shadow.mirror import Mirror, Pair, ShadowSettings
from kvyard.shadow.score import score_tokens

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.005  # how often score_when_idle looks at the primary's worker
KL_BUCKETS = (1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
SHARE_BUCKETS = (0.5, 0.8, 0.9, 0.95, 0.99, 1.0)
DELTA_BUCKETS = (-1.0, -0.3, -0.1, -0.03, -0.01, 0.0, 0.01, 0.03, 0.1, 0.3, 1.0)


class ShadowMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.pairs = Counter("kvyard_shadow_pairs", "Mirrored requests by what became of the pair: scored, "
                             "primary_failed, candidate_failed, score_failed, score_skipped_busy (the primary's worker was never "
                             "idle), dropped (the comparator was busy), unrecorded (the record's writer was busy)",
                             ["outcome"], registry=registry)
        self.exact = Counter("kvyard_shadow_exact_match", "Scored pairs at temperature 0, by whether the "
                             "candidate's text was the primary's", ["match"], registry=registry)
        self.kl = Histogram("kvyard_shadow_kl", "Per pair, the mean teacher-forced KL(primary || candidate) "
                            "over the primary's output tokens, in nats", buckets=KL_BUCKETS, registry=registry)
        self.top1 = Histogram("kvyard_shadow_top1_agreement", "Per pair, the share of the primary's output "
                              "positions where both give the same most likely token", buckets=SHARE_BUCKETS,
                              registry=registry)
        self.ttft = Histogram("kvyard_shadow_ttft_delta_seconds", "Per pair, the candidate's time to first "
                              "token minus the primary's", buckets=DELTA_BUCKETS, registry=registry)
        self.itl = Histogram("kvyard_shadow_itl_delta_seconds", "Per pair, the candidate's mean inter-token "
                             "time minus the primary's", buckets=DELTA_BUCKETS, registry=registry)
        self.json = Counter("kvyard_shadow_json_valid", "Scored answers by side and whether their text is valid "
                            "JSON", ["side", "valid"], registry=registry)
        self.tools = Counter("kvyard_shadow_tool_calls", "Pairs with tool calls, by whether the two sides called "
                             "the same functions with the same arguments", ["agree"], registry=registry)

    def observe(self, s: PairScore) -> None:
        self.pairs.labels("scored").inc()
        if s.greedy:
            self.exact.labels(str(s.exact_match).lower()).inc()
        if s.scored_tokens:  # teacher-forced: KL and top-1 were measured
            self.kl.observe(s.kl_mean)
            self.top1.observe(s.top1_agreement)
        for value, histogram in ((s.ttft_delta_s, self.ttft), (s.itl_delta_s, self.itl)):
            if value is not None:
                histogram.observe(value)
        for side, valid in zip(("primary", "candidate"), s.json_valid, strict=True):
            self.json.labels(side, str(valid).lower()).inc()
        if s.tools_agree is not None:
            self.tools.labels(str(s.tools_agree).lower()).inc()


class LiveComparator:
    def __init__(self, settings: ShadowSettings, primary_client: httpx.AsyncClient,
                 candidate_client: httpx.AsyncClient, tokenizer: Any, metrics: ShadowMetrics,
                 in_flight: Callable[[str], int] = lambda url: 0):
        """`primary_client` reaches the fleet's workers (with their credentials), `candidate_client` the candidate;
        `tokenizer` is the router's kvyard.router.prompts.PromptTokenizer; `in_flight(url)`: the client requests a
        worker has in flight now."""
        self.in_flight = in_flight
        self.settings = settings
        self.primary_client = primary_client
        self.candidate_client = candidate_client
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.queue: asyncio.Queue[Pair] = asyncio.Queue(maxsize=settings.queue)
        self.scores: deque[PairScore] = deque(maxlen=settings.keep)  # the latest, for GET /shadow
        self._random = random.Random()
        self.record: IO[str] | None = None
        self.recorder: BoundedWorker[dict[str, Any]] | None = None
        if settings.record:  # written on a thread of its own: a slow disk never holds up the router's loop
            Path(settings.record).parent.mkdir(parents=True, exist_ok=True)
            self.record = open(settings.record, "a", buffering=1)  # noqa: SIM115 - open for the router's life
            self.recorder = BoundedWorker(self._write_line, "kvyard-shadow-record", settings.queue,
                                          lambda e: log.warning("the shadow record could not be written: %s", e))
        self.task = asyncio.create_task(self._run())

    def submit(self, pair: Pair) -> None:
        """Queue a pair for scoring; never waits (a full queue drops it, counted)."""
        try:
            self.queue.put_nowait(pair)
        except asyncio.QueueFull:
            self.metrics.pairs.labels("dropped").inc()

    async def _run(self) -> None:
        while True:
            pair = await self.queue.get()
            try:
                await self._compare(pair)
            except Exception:  # noqa: BLE001 - one bad pair must not stop the comparator
                log.exception("shadow comparison of %s failed", pair.request_id)
            finally:
                self.queue.task_done()

    async def _compare(self, pair: Pair) -> None:
        if pair.primary is None or pair.candidate is None:
            self.metrics.pairs.labels("primary_failed" if pair.primary is None else "candidate_failed").inc()
            await self._write(pair, None)
            return
        if pair.primary.text and pair.served_by and self._random.random() < self.settings.score:
            try:
                await self._teacher_force(pair)
            except TimeoutError:
                pair.errors["score"] = f"{pair.served_by} was never idle for {self.settings.timeout_s:g} s"
                self.metrics.pairs.labels("score_skipped_busy").inc()
            except (httpx.HTTPError, ValueError, KeyError) as e:
                pair.errors["score"] = f"{type(e).__name__}: {e}"
                self.metrics.pairs.labels("score_failed").inc()
        temperature = pair.body.get("temperature", 1.0)
        score = score_pair(pair.request_id, pair.primary, pair.candidate, greedy=temperature == 0)
        self.metrics.observe(score)
        self.scores.append(score)
        await self._write(pair, score)

    async def _teacher_force(self, pair: Pair) -> None:
        primary, candidate = pair.primary, pair.candidate
        assert primary is not None and candidate is not None and pair.served_by is not None
        prompt_ids = pair.prompt_ids or await self.tokenizer.token_ids(pair.path, pair.body)
        if not prompt_ids:
            raise ValueError("the prompt cannot be tokenized in the router")
        output_ids = await self.tokenizer.output_ids(primary.text)
        if self.settings.score_when_idle:
            await asyncio.wait_for(self._idle(pair.served_by), self.settings.timeout_s)
        model = pair.body.get("model")
        primary.dists, candidate.dists = await asyncio.gather(
            score_tokens(self.primary_client, pair.served_by, model, prompt_ids, output_ids),
            score_tokens(self.candidate_client, self.settings.url, self.settings.candidate_model or model, prompt_ids,
                         output_ids))

    async def _idle(self, url: str) -> None:
        while self.in_flight(url) > 0:
            await asyncio.sleep(IDLE_POLL_S)

    async def _write(self, pair: Pair, score: PairScore | None) -> None:
        if self.recorder is None:
            return
        line: dict[str, Any] = {"id": pair.request_id, "arrived": pair.arrived, "path": pair.path,
                                "model": pair.body.get("model"), "served_by": pair.served_by,
                                "errors": pair.errors, "score": asdict(score) if score else None}
        if not self.settings.redact:
            line["request"] = {k: pair.body[k] for k in ("prompt", "messages", "tools") if k in pair.body}
            prompt = pair.body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                line["request"]["prompt_text"] = await self.tokenizer.text(prompt)  # for the report's reader
            for side in ("primary", "candidate"):
                answer: Answer | None = getattr(pair, side)
                line[side] = None if answer is None else {"text": answer.text, "tool_calls": answer.tool_calls}
        if not self.recorder.submit(line):
            self.metrics.pairs.labels("unrecorded").inc()

    def _write_line(self, line: dict[str, Any]) -> None:
        assert self.record is not None
        self.record.write(json.dumps(line) + "\n")

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        if self.recorder is not None and self.record is not None:
            await asyncio.to_thread(self.recorder.close)  # what is queued is written first
            self.record.close()


class Shadow:
    """The router's shadowing: the mirror that sends the copies and the comparator that scores the pairs."""

    def __init__(self, settings: ShadowSettings, fleet_client: httpx.AsyncClient, tokenizer: Any,
                 registry: CollectorRegistry, counter: Any, in_flight: Callable[[str], int] = lambda url: 0):
        # A client of its own for the candidate: the fleet's credentials stay with the fleet.
        self.candidate_client = httpx.AsyncClient(trust_env=False, timeout=settings.timeout_s)
        self.comparator = LiveComparator(settings, fleet_client, self.candidate_client, tokenizer,
                                         ShadowMetrics(registry), in_flight)
        self.mirror = Mirror(settings, self.candidate_client, counter, on_pair=self.comparator.submit)

    def offer(self, path: str, body: dict[str, Any], prompt_ids: list[int] | None) -> Pair | None:
        pair = self.mirror.offer(path, body)
        if pair is not None:
            pair.prompt_ids = prompt_ids
        return pair

    def verdict(self, budgets: Budgets | None = None) -> dict[str, Any]:
        """The latest scored pairs held against `budgets`, for GET /shadow."""
        v = verdict(list(self.comparator.scores), budgets or Budgets())
        return {"passed": v.passed, "failures": v.failures, "summary": v.summary,
                "worst": [asdict(s) for s in v.worst]}

    async def close(self) -> None:
        await self.mirror.close()
        await self.comparator.close()
        await self.candidate_client.aclose()
