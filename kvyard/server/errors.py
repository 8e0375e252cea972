"""OpenAI-style error responses, `{"error": {"message", "type", "param", "code"}}`, for every failure.

Client mistakes map to 4xx; only our own failures are 5xx. Handlers are registered for each way an
error can surface in FastAPI/Starlette (our `APIError`, the engine's typed errors, pydantic and FastAPI
validation, Starlette's HTTP errors such as 404/405); `InternalErrorMiddleware` catches anything else.
"""

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvyard.errors import (
    AdapterBusyError,
    EngineDeadError,
    InvalidRequestError,
    KvyardError,
    PromptTooLongError,
)

log = logging.getLogger(__name__)

_DEFAULT_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
                  503: "service_unavailable", 504: "timeout_error"}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _DEFAULT_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse_event(self) -> str:
        """The same error as a server-sent event, for failures after a stream has started."""
        return f"data: {json.dumps(self.body())}\n\n"


def from_kvyard_error(e: KvyardError) -> APIError:
    if isinstance(e, PromptTooLongError):
        return APIError(400, str(e), param=e.param, code="context_length_exceeded")
    if isinstance(e, AdapterBusyError):
        return APIError(409, str(e), param=e.param, code="adapter_busy")
    if isinstance(e, InvalidRequestError):
        return APIError(400, str(e), param=e.param)
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_dead")
    return APIError(500, str(e), code="engine_error")


def from_validation_errors(errors: Sequence[Any]) -> APIError:
    """One problem, named by its location in the body (`messages.0.role`)."""
    if not errors:
        return APIError(400, "invalid request body")
    if errors[0].get("type") == "json_invalid":
        ctx = errors[0].get("ctx", {})
        return APIError(400, f"the body is not valid JSON: {ctx.get('error', 'decode error')}", code="invalid_json")
    # A union reports one error per member; the deepest one is usually the one the client meant.
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    # Union members show up as locations (`prompt.str`, `prompt.list[int]`); they only confuse.
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    loc = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "float", "bool")]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)


def _respond(request: Request, error: APIError) -> JSONResponse:
    ctx = getattr(request.app.state, "ctx", None)
    if ctx is not None and error.status < 500:
        # Codes and types come from a fixed set defined here, so the label stays low-cardinality.
        ctx.metrics.rejected.labels(error.code or error.type).inc()
    return error.response()


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return _respond(request, e)

    @app.exception_handler(KvyardError)
    async def _kvyard_error(request: Request, e: KvyardError) -> JSONResponse:
        return _respond(request, from_kvyard_error(e))

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return _respond(request, from_validation_errors(e.errors()))  # 400, not FastAPI's 422

    @app.exception_handler(ValidationError)
    async def _pydantic_validation(request: Request, e: ValidationError) -> JSONResponse:
        return _respond(request, from_validation_errors(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return _respond(request, APIError(e.status_code, str(e.detail), headers=dict(e.headers or {})))


async def send_error(send: Send, error: APIError) -> None:
    """Answer with `error` at the ASGI level (from middleware, outside FastAPI's handlers)."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class InternalErrorMiddleware:
    """Turn an unexpected exception into a 500 with the OpenAI body, and keep the connection usable.

    Starlette's own catch-all re-raises after answering, and uvicorn then drops the connection, which a
    keep-alive client sees as a reset on its next request. This one logs and answers, and that is all.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise  # half a response is out: only dropping the connection can tell the client
            await send_error(send, APIError(500, "internal server error", code="internal_error"))
