"""`GET /openapi.json`: the API described from the same pydantic models that validate it.

The generation routes take the raw request and validate the body themselves (strict types, OpenAI
error bodies, 400 instead of FastAPI's 422), so FastAPI alone would describe them without a body.
Here the request and response models are added to the generated schema, which makes it useful to
clients and to schema-driven fuzzing (tests/server/test_schemathesis.py).
"""

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from kvyard.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelList,
)
from kvyard.server.tokenize_api import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

# path -> (method, request body model or None, response model, streams when the body says stream: true)
_ROUTES: dict[str, tuple[str, type[BaseModel] | None, type[BaseModel], type[BaseModel] | None]] = {
    "/v1/completions": ("post", CompletionRequest, CompletionResponse, CompletionResponse),
    "/v1/chat/completions": ("post", ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk),
    "/v1/models": ("get", None, ModelList, None),
    "/tokenize": ("post", TokenizeRequest, TokenizeResponse, None),
    "/detokenize": ("post", DetokenizeRequest, DetokenizeResponse, None),
}

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

# What any route may answer besides success; the guards (auth, size, drain, admission) apply to all.
_ERRORS = {
    "400": "invalid request (the error names the offending field in `param`)",
    "401": "missing or invalid API key",
    "404": "unknown model",
    "413": "request body too large",
    "429": "too many requests queued; retry after `Retry-After` seconds",
    "503": "the server is draining or its engine has stopped",
    "504": "the request did not finish within the server's request timeout",
}


def install_openapi(app: FastAPI) -> None:
    """Serve the described schema at `app.openapi_url` (built on first request, then cached)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_schema(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_schema(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    models: list[tuple[type[BaseModel], JsonSchemaMode]] = []
    for _, request, response, chunk in _ROUTES.values():
        if request is not None:
            models.append((request, "validation"))
        models.append((response, "serialization"))
        if chunk is not None and chunk is not response:
            models.append((chunk, "serialization"))
    refs, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(defs.get("$defs", {}))
    components["Error"] = _ERROR
    error_ref = {"$ref": "#/components/schemas/Error"}

    for path, (method, request, response, chunk) in _ROUTES.items():
        op = schema["paths"].get(path, {}).get(method)
        if op is None:
            continue
        content: dict[str, Any] = {"application/json": {"schema": refs[(response, "serialization")]}}
        if chunk is not None:
            # One JSON chunk per `data:` event, then `data: [DONE]`.
            content["text/event-stream"] = {"schema": {"type": "string"},
                                            "x-event-schema": refs[(chunk, "serialization")]}
        op["responses"] = {"200": {"description": "success", "content": content}}
        op["responses"].update({code: {"description": why, "content": {"application/json": {"schema": error_ref}}}
                                for code, why in _ERRORS.items()})
        if request is not None:
            op["requestBody"] = {"required": True,
                                 "content": {"application/json": {"schema": refs[(request, "validation")]}}}
    return schema
