"""From a validated OpenAI request to engine requests and back: sampling params, fan-out, deadline.

One HTTP request becomes `len(prompts) * n` engine requests (choices). `EngineRun` submits them all at
once, merges their outputs from one queue, enforces the deadline, records metrics, and on every way out
(finished, error, timeout, client gone, drain) aborts whatever is still running so its KV blocks are
freed at once.
"""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from kvyard.engine.soft_tokens import SoftTokens
from kvyard.errors import InvalidRequestError, KvyardError
from kvyard.outputs import RequestOutput
from kvyard.sampling_params import SamplingParams
from kvyard.server.async_engine import RequestFailedError, SinkItem
from kvyard.server.context import ServerContext
from kvyard.server.errors import APIError, from_kvyard_error
from kvyard.server.protocol import KVTransferParams, SamplingFields
from kvyard.server.repetition import RepetitionGuard, request_guard
from kvyard.server.sse import DONE, ClientDisconnected
from kvyard.shadow.capture import Observed

log = logging.getLogger(__name__)

# One HTTP request may not fan out further than this (prompts x n); beyond it a client should batch.
MAX_CHOICES = 256

_OPTIONAL_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "seed", "ignore_eos", "min_tokens", "skip_special_tokens")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# Finish reasons of a choice that produced a result; anything else (abort, error) is a failure.
_COMPLETED = ("stop", "length", "repetition")


def guard_for(ctx: ServerContext, body: SamplingFields) -> RepetitionGuard:
    """The repetition guard of this request: the deployment's, overridden by the request's fields."""
    vllm = body.repetition_detection
    own = body.repetition_guard
    return request_guard(
        ctx.settings.guard,
        None if own is None else own.model_dump(exclude_none=True),
        None if vllm is None else vllm.model_dump(include={"max_pattern_size", "min_pattern_size", "min_count"}),
    )


def sampling_params(body: SamplingFields, max_tokens: int, logprobs: int | None, vocab_size: int,
                    guard: RepetitionGuard | None = None, defaults: dict[str, float | int] | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """Validated SamplingParams (InvalidRequestError names the field) from the fields the client set.

    A field the client left out takes the model's default (`defaults`, generation_config.json) where it
    has one, else SamplingParams' own; max_tokens is settled by the endpoint (`default_max_tokens`).
    """
    kwargs = {name: value for name, value in (defaults or {}).items() if name != "max_tokens"}
    kwargs.update({name: getattr(body, name) for name in _OPTIONAL_FIELDS if getattr(body, name) is not None})
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    stop_token_ids = list(body.stop_token_ids or [])
    if any(t >= vocab_size for t in stop_token_ids):
        # The sampler indexes logits with these; out-of-vocabulary ids must never reach it.
        raise InvalidRequestError(f"stop_token_ids must be below the vocabulary size {vocab_size}",
                                  param="stop_token_ids")
    detection = guard.detection if guard is not None and guard.enabled else None
    return SamplingParams(max_tokens=max_tokens, stop=stop, stop_token_ids=stop_token_ids, logprobs=logprobs,
                          n=1 if body.n is None else body.n, repetition_detection=detection,
                          logit_bias=logit_bias(body.logit_bias, vocab_size), prompt_logprobs=prompt_logprobs,
                          **kwargs)


def logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's `{"token id": bias}` as token ids, each checked against the vocabulary (values: SamplingParams)."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if key.isascii() and key.isdigit() else -1
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(f"logit_bias: {key!r} is not a token id of this model (0 to {vocab_size - 1})",
                                      param="logit_bias")
        out[token] = value
    return out


def default_max_tokens(defaults: dict[str, float | int], fallback: int) -> int:
    """max_tokens for a request that gives none: the endpoint's default, capped by the model's
    max_new_tokens (vLLM takes the smaller of the two as well)."""
    model = defaults.get("max_tokens")
    return fallback if model is None else max(1, min(fallback, int(model)))


@dataclass
class Choice:
    index: int
    prompt_index: int
    request_id: str  # of its current engine request (a repetition retry starts a new one)
    prompt: list[int]
    params: SamplingParams
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished: bool = False
    attempt: int = 0  # repetition retries so far
    sent: bool = False  # a stream has passed some of its tokens on: too late to retry
    # When captured (kvyard/shadow/capture.py): each output's arrival and its count of new tokens
    token_times: list[float] = field(default_factory=list)
    token_counts: list[int] = field(default_factory=list)


class EngineRun:
    def __init__(self, ctx: ServerContext, request_id: str, arrival: float | None = None,
                 guard: RepetitionGuard | None = None, streaming: bool = False, lora: str | None = None,
                 soft_tokens: list[SoftTokens] | None = None):
        self.ctx = ctx
        self.lora = lora  # the LoRA adapter every choice runs with (the request's model), None: the base model
        self.soft_tokens = soft_tokens  # a grafted image's embeddings in the prompt (kvyard/vision/runtime.py)
        self.request_id = request_id
        self.guard = guard or RepetitionGuard()
        self.streaming = streaming
        # When the HTTP request arrived (time.monotonic()): latencies and the deadline count from there.
        self.arrival = time.monotonic() if arrival is None else arrival
        timeout = ctx.settings.request_timeout
        self.deadline = None if timeout is None else self.arrival + timeout
        self.queue: asyncio.Queue[SinkItem | None] = asyncio.Queue()  # None: wake up, see _interrupted
        self.choices: dict[str, Choice] = {}
        self._closed = False
        self._interrupted: APIError | None = None
        self.captured = ctx.capture is not None and ctx.capture.sampled()
        self.arrival_unix = time.time() - (time.monotonic() - self.arrival)

    async def start(self, prompts: list[list[int]], params: SamplingParams,
                    kv_transfer: KVTransferParams | None = None) -> None:
        """Submit every choice together (one trip to the engine thread); all are accepted or none.

        With `kv_transfer`, the prompt's KV is pulled from a prefill worker first (kvyard/server/disagg.py).
        """
        n = params.n
        if len(prompts) * n > MAX_CHOICES:
            raise InvalidRequestError(f"prompts x n must not exceed {MAX_CHOICES}", param="n")
        received = await self.ctx.disagg.receive(prompts, kv_transfer)
        submits = []
        for p, ids in enumerate(prompts):
            for i in range(n):
                index = p * n + i
                rid = f"{self.request_id}-{index}"
                # n > 1: each copy its own seed, so seeded choices differ yet stay reproducible.
                copy = replace(params, n=1, seed=None if params.seed is None else params.seed + i)
                self.choices[rid] = Choice(index, p, rid, ids, copy, prompt_tokens=len(ids))
                # Only the first add carries the KV: it is adopted into the prefix cache, the rest hit it.
                kv, received = received, None
                submits.append(self.ctx.engine.add_request(ids, copy, rid, sink=self.queue, received=kv,
                                                           lora=self.lora, soft_tokens=self.soft_tokens))
        self.ctx.drain.runs.add(self)
        results = await asyncio.gather(*submits, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.close("rejected")
            raise errors[0]

    async def outputs(self) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Every output of every choice, as produced, until all have finished."""
        remaining = len(self.choices)
        while remaining:
            item = await self._next()
            if self._interrupted is not None:
                raise self._interrupted
            if isinstance(item, RequestFailedError):
                raise APIError(500, str(item), code="engine_error")
            assert item is not None
            choice = self.choices[item.request_id]
            reason = item.outputs[0].finish_reason if item.finished else None
            if reason == "repetition" and self._may_retry(choice):
                self._observe(choice, item, final=False)
                await self._retry(choice)
                continue
            self._observe(choice, item, final=item.finished)
            if item.finished:
                choice.finished = True
                remaining -= 1
                self.ctx.metrics.requests.labels(reason or "unknown").inc()
                if reason == "repetition":
                    self.ctx.metrics.repetition_guard_trips.labels("stop").inc()
                if choice.attempt:
                    outcome = "repeated" if reason == "repetition" else "recovered"
                    self.ctx.metrics.repetition_guard_retries.labels(outcome).inc()
                if reason not in _COMPLETED:
                    raise APIError(500, f"generation failed (finish_reason={reason})", code="engine_error")
            elif self.streaming and item.outputs[0].delta_token_ids:
                choice.sent = True
            yield choice, item

    def _may_retry(self, choice: Choice) -> bool:
        g = self.guard
        return g.action == "retry" and not choice.sent and choice.attempt < g.max_retries

    async def _retry(self, choice: Choice) -> None:
        """Generate a choice that looped again, as a new engine request feeding the same queue."""
        metrics = self.ctx.metrics
        metrics.repetition_guard_trips.labels("retry").inc()
        if choice.attempt:
            metrics.repetition_guard_retries.labels("repeated").inc()  # the previous retry looped too
        choice.attempt += 1
        del self.choices[choice.request_id]
        choice.request_id = f"{self.request_id}-{choice.index}-retry{choice.attempt}"
        self.choices[choice.request_id] = choice
        choice.completion_tokens = 0  # usage counts the tokens the client gets
        params = self.guard.retry_params(choice.params, choice.attempt)
        log.info("%s looped; retry %d with repetition_penalty %.2f", self.request_id, choice.attempt,
                 params.repetition_penalty)
        await self.ctx.engine.add_request(choice.prompt, params, choice.request_id, sink=self.queue, lora=self.lora,
                                          soft_tokens=self.soft_tokens)

    async def _next(self) -> SinkItem | None:
        if self.deadline is None:
            return await self.queue.get()
        try:
            return await asyncio.wait_for(self.queue.get(), max(0.0, self.deadline - time.monotonic()))
        except TimeoutError:
            self.close("timeout")
            raise APIError(504, f"the request did not finish within {self.ctx.settings.request_timeout} s",
                           code="request_timeout") from None

    def _observe(self, choice: Choice, out: RequestOutput, final: bool) -> None:
        new = len(out.outputs[0].delta_token_ids)
        if not new:
            return
        now = time.monotonic()
        m = self.ctx.metrics
        if choice.first_token_at is None:
            choice.first_token_at = now
            m.ttft.observe(now - self.arrival)
            m.prompt_tokens.inc(choice.prompt_tokens)
        elif choice.last_token_at is not None:
            for _ in range(new):
                m.itl.observe((now - choice.last_token_at) / new)
        choice.last_token_at = now
        choice.completion_tokens += new
        m.generation_tokens.inc(new)
        if self.captured:
            choice.token_times.append(now)
            choice.token_counts.append(new)
        if final:
            m.e2e.observe(now - self.arrival)
            if self.captured:
                self._capture(choice, out)

    def _capture(self, choice: Choice, out: RequestOutput) -> None:
        assert self.ctx.capture is not None
        done = out.outputs[0]
        self.ctx.capture.submit(Observed(self.arrival_unix, choice.prompt, choice.params, list(done.token_ids),
                                         done.text, done.finish_reason, choice.token_times, choice.token_counts, self.arrival))

    def interrupt(self, error: APIError) -> None:
        """From outside (the drain): abort all choices and make `outputs` raise `error`."""
        self._interrupted = error
        self.queue.put_nowait(None)
        self.close("shutdown")

    def close(self, outcome: str = "cancelled") -> None:
        """Abort unfinished choices (freeing their KV blocks) and count them under `outcome`. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.ctx.drain.runs.discard(self)
        for choice in self.choices.values():
            if not choice.finished:
                choice.finished = True
                self.ctx.engine.abort_nowait(choice.request_id)
                if outcome != "rejected":
                    self.ctx.metrics.requests.labels(outcome).inc()

    @contextmanager
    def closing(self) -> Iterator[None]:
        """Close on the way out with the right outcome: the client left, something failed, or done."""
        try:
            yield
        except (asyncio.CancelledError, GeneratorExit, ClientDisconnected):
            self.close("cancelled")
            raise
        except BaseException:
            self.close("error")
            raise
        finally:
            self.close()  # finished normally: nothing is open, so this only unregisters the run

    def usage(self) -> dict[str, int]:
        # OpenAI counts each prompt once, however many choices share it.
        prompt = sum({c.prompt_index: c.prompt_tokens for c in self.choices.values()}.values())
        completion = sum(c.completion_tokens for c in self.choices.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def api_error_for(e: BaseException) -> APIError:
    """Any failure during generation, as the API error to send (used where handlers cannot raise)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, KvyardError):
        return from_kvyard_error(e)
    log.error("generation failed", exc_info=e)
    return APIError(500, "internal server error", code="internal_error")


async def event_stream(run: EngineRun, events: AsyncIterator[str],
                       usage_event: Callable[[], str] | None) -> AsyncIterator[str]:
    """An endpoint's SSE chunks, then usage if asked; a failure becomes an error event, never a crash.

    Every way out aborts the run's unfinished engine requests, and the stream always ends with [DONE].
    """
    with run.closing():
        try:
            async for event in events:
                yield event
            if usage_event is not None:
                yield usage_event()
        except Exception as e:
            run.close("error")  # a timeout or drain already closed it under its own outcome
            yield api_error_for(e).sse_event()
        yield DONE
