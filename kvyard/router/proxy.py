"""Forwarding a request to the chosen worker: non-streaming and streaming (SSE passed through event by event).

Failures before anything reached the client are retried on another worker (up to `max_attempts`): a
refused or reset connection, a 502/503 answer, a stream that breaks before its first event, and for
non-streaming requests any failure at all (the client has seen nothing yet). A stream that breaks later
cannot be replayed, so it ends with an OpenAI-style error event and `[DONE]`: no request ever hangs or
ends silently. A worker declared dead by the health checker cuts its streams the same way at once.
"""

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import httpx
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvyard.net import sse_events
from kvyard.router.observed import Observed
from kvyard.router.placement import Decision, Placement
from kvyard.router.policies import Policy, RouteRequest
from kvyard.router.registry import WorkerRegistry
from kvyard.router.worker import Worker
from kvyard.shadow.answers import AnswerReader

log = logging.getLogger(__name__)

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
_FORWARD_HEADERS = ("authorization", "content-type", "accept")
_KEEP_RESPONSE_HEADERS = ("content-type", "retry-after")
_RETRY_STATUS = (502, 503)


class WorkerFailed(Exception):
    """The worker could not be reached or died before answering."""


def error_body(status: int, message: str, code: str) -> dict[str, object]:
    kind = (
        "invalid_request_error"
        if status < 500
        else "service_unavailable"
        if status == 503
        else "server_error"
    )
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def error_event(message: str) -> bytes:
    return f"data: {json.dumps(error_body(502, message, 'worker_failed'))}\n\n".encode()


async def until_dead(worker: Worker, work: Awaitable[T]) -> T:
    """Await `work`, unless the worker is declared dead first (then raise WorkerFailed)."""
    task = asyncio.ensure_future(work)
    dead = asyncio.ensure_future(worker.dead.wait())
    try:
        await asyncio.wait({task, dead}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise WorkerFailed(f"worker {worker.url} was declared dead")
    finally:
        for t in (task, dead):
            t.cancel()


def forwarded_headers(headers: dict[str, str], client: httpx.AsyncClient) -> dict[str, str]:
    """The client's headers a worker sees. The client's Authorization is passed through only when the router
    has no worker key of its own (its client then sends that one on every request)."""
    own_key = "authorization" in client.headers
    return {k: v for k, v in headers.items()
            if k.lower() in _FORWARD_HEADERS and not (own_key and k.lower() == "authorization")}


class Proxy:
    def __init__(
        self, placement: Placement, registry: WorkerRegistry, client: httpx.AsyncClient, max_attempts: int
    ):
        self.placement = placement
        self.registry = registry
        self.client = client
        self.max_attempts = max_attempts
        self.metrics = registry.metrics
        self.observed = Observed()  # for the operator's console

    async def forward(
        self, path: str, raw: bytes, stream: bool, req: RouteRequest, headers: dict[str, str],
        policy: Policy | None = None, watch: AnswerReader | None = None,
    ) -> Response:
        """Place the request (with `policy`, default the router's) and relay the worker's answer. `watch` reads the
        answer as it is relayed (a shadowed request's primary side) and is closed once it has ended or failed:
        here for a whole answer, by the relay for a stream."""
        fwd = forwarded_headers(headers, self.client)
        arrival = time.monotonic()
        tried: set[str] = set()
        last_error = "no worker is healthy"
        for _ in range(self.max_attempts):
            d = self.placement.pick(req, tried, policy=policy)
            if d is None:
                break
            if tried:
                self.metrics.retries.labels("worker_failed").inc()
            tried.add(d.worker.url)
            self.placement.begin(d, req)
            self.observed.decided(d.worker.url, d.reason)
            if watch is not None:
                watch.served_by = d.worker.url
            try:
                if stream:
                    response = await self._stream(d, req, path, raw, fwd, arrival, watch)
                else:
                    response = await self._once(d, req, path, raw, fwd, watch)
            except WorkerFailed as e:
                self.placement.end(d, req)
                last_error = str(e)
                self.metrics.requests.labels(d.worker.url, "retried").inc()
                log.warning("%s", e)
                continue
            if watch is not None and not isinstance(response, StreamingResponse):
                watch.close()
            return response
        if watch is not None:
            watch.close()  # no answer at all
        body = error_body(503, f"no worker could take the request: {last_error}", "no_worker_available")
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})

    def _fail(self, d: Decision, e: BaseException) -> WorkerFailed:
        reason = f"{type(e).__name__}: {e}" if not isinstance(e, WorkerFailed) else str(e)
        if isinstance(e, httpx.TransportError):
            self.registry.mark_dead(d.worker, reason)  # cannot connect, or the connection broke
        return WorkerFailed(f"worker {d.worker.url} failed: {reason}")

    async def _once(
        self, d: Decision, req: RouteRequest, path: str, raw: bytes, fwd: dict[str, str], watch: AnswerReader | None
    ) -> Response:
        try:
            r = await until_dead(d.worker, self.client.post(d.worker.url + path, content=raw, headers=fwd))
        except (httpx.TransportError, WorkerFailed) as e:
            raise self._fail(d, e) from e
        if r.status_code in _RETRY_STATUS:
            raise WorkerFailed(f"worker {d.worker.url} answered {r.status_code}")
        self.placement.end(d, req)
        self.metrics.requests.labels(d.worker.url, str(r.status_code)).inc()
        if watch is not None and r.status_code == 200:
            watch.whole(r.content)
        return Response(r.content, status_code=r.status_code, headers=self._headers(r, d))

    def _headers(self, r: httpx.Response, d: Decision) -> dict[str, str]:
        out = {k: v for k, v in r.headers.items() if k.lower() in _KEEP_RESPONSE_HEADERS}
        out["x-kvyard-worker"] = d.worker.url
        return out

    async def _stream(
        self, d: Decision, req: RouteRequest, path: str, raw: bytes, fwd: dict[str, str], arrival: float,
        watch: AnswerReader | None,
    ) -> Response:
        upstream = self.client.build_request("POST", d.worker.url + path, content=raw, headers=fwd)
        try:
            resp = await until_dead(d.worker, self.client.send(upstream, stream=True))
        except (httpx.TransportError, WorkerFailed) as e:
            raise self._fail(d, e) from e
        if resp.status_code != 200:
            content = await resp.aread()
            await resp.aclose()
            if resp.status_code in _RETRY_STATUS:
                raise WorkerFailed(f"worker {d.worker.url} answered {resp.status_code}")
            self.placement.end(d, req)
            self.metrics.requests.labels(d.worker.url, str(resp.status_code)).inc()
            return Response(content, status_code=resp.status_code, headers=self._headers(resp, d))
        events = sse_events(resp)
        try:
            # Nothing is sent to the client before the first event: until then a failure can be retried.
            first = await until_dead(d.worker, anext(events))
        except (httpx.TransportError, WorkerFailed, StopAsyncIteration) as e:
            await resp.aclose()
            raise self._fail(
                d, e if not isinstance(e, StopAsyncIteration) else WorkerFailed("empty stream")
            ) from e
        self.observed.record_ttft(time.monotonic() - arrival)
        relay = self._relay(d, req, resp, first, events, watch)
        return StreamingResponse(relay, headers=self._headers(resp, d))

    async def _relay(
        self, d: Decision, req: RouteRequest, resp: httpx.Response, first: bytes, events: AsyncIterator[bytes],
        watch: AnswerReader | None,
    ) -> AsyncIterator[bytes]:
        outcome = "200"
        # A dead worker may hang rather than close the connection: closing the response cuts the stream.
        watcher = asyncio.ensure_future(self._close_when_dead(d.worker, resp))
        try:
            if watch is not None:
                watch.event(first)
            yield first
            done = first == DONE
            last = time.monotonic()
            try:
                async for event in events:
                    now = time.monotonic()
                    if event != DONE:
                        self.observed.itl.append(now - last)
                    last = now
                    if watch is not None:
                        watch.event(event)
                    yield event
                    done = done or event == DONE
                if not done:
                    raise WorkerFailed("the stream ended without [DONE]")
            except Exception as e:  # noqa: BLE001 - whatever broke the stream, the client gets an error event
                outcome = "cut"
                err = (
                    self._fail(d, e)
                    if not d.worker.dead.is_set()
                    else WorkerFailed(f"worker {d.worker.url} died")
                )
                log.warning("stream cut: %s", err)
                yield error_event(f"the stream was cut: {err}")
                yield DONE
        finally:
            watcher.cancel()
            if watch is not None:
                watch.close()
            await resp.aclose()
            self.placement.end(d, req)
            self.metrics.requests.labels(d.worker.url, outcome).inc()

    async def _close_when_dead(self, worker: Worker, resp: httpx.Response) -> None:
        await worker.dead.wait()
        await resp.aclose()
