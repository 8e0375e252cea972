"""What stands between a client and the engine: drain, auth, body size, admission control.

The first three are one pure-ASGI middleware (Starlette's BaseHTTPMiddleware would buffer streams and
swallow cancellation); admission control runs inside the handlers, because only they know how many
engine requests an HTTP request becomes. Deadlines and cancellation live with the engine requests
(`generation.EngineRun`, `sse`).
"""

import hmac
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvyard.cluster.auth import HEADER, token_matches
from kvyard.server.async_engine import AsyncEngine
from kvyard.server.errors import APIError, send_error
from kvyard.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from kvyard.server.generation import EngineRun

# Reachable while draining and without a key: load balancers and scrapers must see the state.
_OPEN_PATHS = ("/health",)
_DRAIN_EXEMPT = ("/health", "/metrics")


@dataclass
class DrainState:
    """Set by the SIGTERM handler; read by the middleware and by the drain loop in `lifecycle`."""

    draining: bool = False
    in_flight: int = 0  # HTTP requests being served (not counting /health and /metrics)
    runs: set["EngineRun"] = field(default_factory=set)  # engine work to interrupt if the drain times out


class Admission:
    """Bounded queue: refuse with 429 while `max_queue` requests wait for the engine.

    Counts requests waiting in the scheduler, submitted but not yet taken in by the engine thread, and
    admitted here but still being tokenized. A request that fans out to n engine requests is admitted
    as one, so a large n is never refused forever on an idle server.
    """

    def __init__(self, engine: AsyncEngine, max_queue: int | None):
        self._engine = engine
        self._max_queue = max_queue
        self._admitting = 0

    def queued(self) -> int:
        s = self._engine.stats()
        return s.num_waiting + s.num_pending + self._admitting

    @contextmanager
    def admit(self) -> Iterator[None]:
        if self._max_queue is not None and self.queued() >= self._max_queue:
            raise APIError(
                429, f"the server is busy ({self._max_queue} requests queued); retry shortly",
                code="rate_limit_exceeded", headers={"Retry-After": "1"},
            )
        self._admitting += 1
        try:
            yield
        finally:
            self._admitting -= 1


UNAUTHORIZED = APIError(401, "missing or invalid API key (Authorization: Bearer KEY)", code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"})


BAD_CLUSTER_TOKEN = APIError(401, "cluster routes need this deployment's cluster token (X-Kvyard-Cluster-Token) "
                             "or the API key", code="invalid_cluster_token")


def bearer_matches(scope: Scope, api_key: str) -> bool:
    value = (_header(scope, b"authorization") or "").strip()
    scheme, _, token = value.partition(" ")
    # Constant-time comparison: response timing must not leak the key.
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


class ApiKeyMiddleware:
    """Only `Authorization: Bearer api_key` gets past, on every path but /health (the router's guard; the
    server's GuardMiddleware does the same among its other checks)."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS and not bearer_matches(scope, self.api_key):
            await send_error(send, UNAUTHORIZED)
            return
        await self.app(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


class GuardMiddleware:
    def __init__(self, app: ASGIApp, drain: DrainState, metrics: ServerMetrics,
                 api_key: str | None, max_body_bytes: int, cluster_token: str | None = None):
        self.app = app
        self.drain = drain
        self.metrics = metrics
        self.api_key = api_key
        self.cluster_token = cluster_token
        self.max_body_bytes = max_body_bytes

    def _authorized(self, scope: Scope, path: str) -> bool:
        """/health is open. /kv/* (cluster-internal) takes the cluster token or the API key, when either is set;
        every other path the API key, when set (kvyard/cluster/auth.py)."""
        if path in _OPEN_PATHS:
            return True
        key_ok = self.api_key is not None and bearer_matches(scope, self.api_key)
        if path.startswith("/kv/") and self.cluster_token is not None:
            return key_ok or token_matches(_header(scope, HEADER.encode()), self.cluster_token)
        return self.api_key is None or key_ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if self.drain.draining and path not in _DRAIN_EXEMPT:
            self.metrics.rejected.labels("draining").inc()
            await send_error(send, APIError(503, "the server is shutting down", code="server_draining",
                                        headers={"Connection": "close", "Retry-After": "5"}))
            return
        if not self._authorized(scope, path):
            self.metrics.rejected.labels("unauthorized").inc()
            cluster_route = path.startswith("/kv/") and self.cluster_token is not None
            await send_error(send, BAD_CLUSTER_TOKEN if cluster_route else UNAUTHORIZED)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await self._too_large(send)
            return
        counted = int(path not in _DRAIN_EXEMPT)
        self.drain.in_flight += counted
        started = False

        async def send_tracking(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, self._limited(receive), send_tracking)
        except _BodyTooLarge:
            if not started:
                await self._too_large(send)
        finally:
            self.drain.in_flight -= counted

    def _limited(self, receive: Receive) -> Receive:
        """Count body bytes as they arrive: chunked uploads have no Content-Length to check up front."""
        total = 0

        async def wrapped() -> Message:
            nonlocal total
            message = await receive()
            if message["type"] == "http.request":
                total += len(message.get("body", b""))
                if total > self.max_body_bytes:
                    raise _BodyTooLarge()
            return message

        return wrapped

    async def _too_large(self, send: Send) -> None:
        self.metrics.rejected.labels("body_too_large").inc()
        await send_error(send, APIError(413, f"the request body exceeds {self.max_body_bytes} bytes",
                                    code="request_too_large", headers={"Connection": "close"}))


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None

