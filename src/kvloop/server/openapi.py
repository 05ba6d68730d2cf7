"""The OpenAPI document (``/openapi.json``): request bodies and error responses declared.

The routes read and validate their bodies themselves (strict parsing, OpenAI-shaped 400s,
off the event loop), so FastAPI cannot infer the bodies from their signatures. Each route
declares its request body as a reference to its pydantic model (``request_body``) and its
error responses with the ``ErrorResponse`` model (``errors``); ``install`` adds those models'
JSON schemas to ``components`` and, with an API key, the bearer security scheme.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from kvloop.server.errors import ErrorResponse
from kvloop.server.protocol import ChatCompletionRequest, CompletionRequest

MODELS: tuple[type[BaseModel], ...] = (CompletionRequest, ChatCompletionRequest, ErrorResponse)
"""Models whose schemas ``install`` adds to ``components`` (routes refer to them by name)."""

_DESCRIPTIONS = {
    400: "Invalid request: malformed JSON, a wrong type, an unknown field or an invalid "
         "value (`param` names the field).",
    401: "Missing or wrong API key (only when the server runs with `--api-key`; any path "
         "under /v1).",
    404: "The `model` is not served here.",
    413: "The request body is larger than `--max-request-bytes`.",
    429: "Too many requests waiting (`--max-queued-requests`) or prompts being encoded; "
         "retry after `Retry-After` seconds.",
    500: "The model step or the engine failed for this request.",
    503: "The server is shutting down (draining) or its engine is not running.",
}
_HEADERS: dict[int, dict[str, Any]] = {
    401: {"WWW-Authenticate": {"description": "`Bearer`", "schema": {"type": "string"}}},
    429: {"Retry-After": {"description": "Seconds to wait before retrying.",
                          "schema": {"type": "integer", "minimum": 0}}},
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for these error statuses, each an OpenAI error body."""
    out: dict[int | str, dict[str, Any]] = {}
    # NOTE: ``content`` spelled out rather than ``model=``, which FastAPI would file under
    # the route's own media type (text/plain for /metrics).
    content = {"application/json": {"schema": _ref(ErrorResponse)}}
    for status in statuses:
        entry: dict[str, Any] = {"description": _DESCRIPTIONS[status], "content": content}
        if status in _HEADERS:
            entry["headers"] = _HEADERS[status]
        out[status] = entry
    return out


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra=`` declaring a JSON request body of ``model``."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": _ref(model)}}}}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"type": "string",
                 "description": "A JSON chunk (or an error object), then `[DONE]`."},
        "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"},
    },
}
"""One server-sent event. NOTE: before OpenAPI 3.2 (FastAPI writes 3.1) the schema of
``text/event-stream`` is read as the schema of each event, as schemathesis does."""

STREAMED_OR_JSON = {200: {
    "description": "The completion as JSON, or with `stream: true` as server-sent events "
                   "(`data: {chunk}` lines, then `data: [DONE]`).",
    "content": {"application/json": {"schema": {"type": "object"}},
                "text/event-stream": {"schema": SSE_EVENT}},
}}
"""The success response of the completion routes."""


def install(app: FastAPI, *, api_key: bool) -> None:
    """Make ``app.openapi()`` build (once) the document described in the module docstring."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                          description=app.description or None)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in MODELS:
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        if api_key:
            doc["components"]["securitySchemes"] = {
                "bearerAuth": {"type": "http", "scheme": "bearer"}}
            for path, item in doc.get("paths", {}).items():
                if path == "/v1" or path.startswith("/v1/"):
                    for operation in item.values():
                        operation["security"] = [{"bearerAuth": []}]
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
