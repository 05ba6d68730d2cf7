"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure.

Handlers raise :class:`APIError`; the exception handlers installed by :func:`install` turn it,
FastAPI's validation errors, unknown routes and unexpected exceptions into that JSON shape.
``code`` is the HTTP status, as vLLM sends it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvloop.server.limits import BODY_TIMEOUT_KEY

logger = logging.getLogger("kvloop.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


CLIENT_CLOSED = 499
"""Status logged for a request whose client went away (nothing is sent)."""
RETRY_AFTER_S = 1
"""``Retry-After`` (seconds) of a 429 that does not name its own."""


class APIError(Exception):
    """An error the API reports to the client with ``status`` and an OpenAI error body.

    ``headers`` go with the response (e.g. ``Allow`` of a 405); a 401 adds
    ``WWW-Authenticate: Bearer`` and a 429 ``Retry-After`` unless given.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers: dict[str, str] = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)

    def response_headers(self) -> dict[str, str]:
        """The response's headers: the given ones plus those the status calls for."""
        headers = dict(self.headers)
        if self.status == 401:
            headers.setdefault("WWW-Authenticate", "Bearer")
        if self.status == 429:
            headers.setdefault("Retry-After", str(RETRY_AFTER_S))
        return headers

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status,
                            headers=self.response_headers() or None)


class ErrorInfo(BaseModel):
    """The ``error`` object of an OpenAI error response."""

    message: str
    """What went wrong, for people."""
    type: str
    """A category: ``invalid_request_error``, ``authentication_error``, ..."""
    param: str | None = None
    """The request field at fault, if one is."""
    code: int
    """The HTTP status (as vLLM sends it)."""


class ErrorResponse(BaseModel):
    """Every non-2xx response body (the OpenAPI document's error schema)."""

    error: ErrorInfo


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error object for ``status``."""
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """A 400 naming the first invalid field of a request body (malformed JSON included)."""
    errors = list(exc.errors())
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        ctx = first.get("ctx") or {}
        detail = str(ctx.get("error", first.get("msg", "")))
        if "hex escape" in detail:  # NOTE: the parser's words for a lone UTF-16 surrogate
            detail += (" (a \\uD800-\\uDFFF escape must be a high surrogate followed by a low "
                       "one: a lone surrogate is not Unicode text)")
        return bad_request(f"malformed JSON body: {detail}")
    if kind == "model_type" and not loc:
        return bad_request("the request body must be a JSON object")
    field = loc[0] if loc else None
    if kind == "extra_forbidden":
        return bad_request(f"unknown field {'.'.join(loc)!r}", param=field)
    if kind == "missing":
        return bad_request(f"field {'.'.join(loc)!r} is required", param=field)
    # NOTE: a union reports one error per branch, its loc naming the branch type; the field
    # path without those branch names is what the client wrote.
    where = ".".join(p for p in loc if not _is_type_name(p)) or "body"
    got = first.get("input")
    branches = _union_branches(errors, loc)
    if len(branches) > 1:  # NOTE: the first branch's message alone ("a valid string") misleads
        return bad_request(f"{where}: expected one of {', '.join(branches)} (got {got!r})",
                           param=field)
    return bad_request(f"{where}: {first.get('msg', 'invalid value')} (got {got!r})", param=field)


def _union_branches(errors: list[Any], loc: list[str]) -> list[str]:
    """The branch types of the union ``loc`` (the first error's path) fails, in order: the
    type names that follow its field path in the errors of that path (empty: no union)."""
    cut = next((i for i, p in enumerate(loc) if _is_type_name(p)), None)
    if cut is None:
        return []
    prefix, branches = loc[:cut], []
    for e in errors:
        path = [str(p) for p in e.get("loc", ()) if p != "body"]
        if (len(path) > cut and path[:cut] == prefix and _is_type_name(path[cut])
                and path[cut] not in branches):
            branches.append(path[cut])
    return branches


def _is_type_name(part: str) -> bool:
    return any(c in part for c in "[]") or part in {"str", "int", "float", "bool"} or (
        part[:1].isupper()
    )


def install(app: FastAPI) -> None:
    """Route every error through the OpenAI error shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # NOTE: keeps the exception's headers (a 405's ``Allow``).
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, _: ClientDisconnect) -> Response:
        # NOTE: a client that closes its connection mid-upload is the client's business:
        # one line, no traceback (and nothing can be sent back). When the server closed it
        # (``connection.py``: the body was too slow), that one line was logged there.
        client = request.client
        level = logging.DEBUG if request.scope.get(BODY_TIMEOUT_KEY) else logging.INFO
        logger.log(level, "%s closed the connection before its request body arrived (%s %s)",
                   f"{client.host}:{client.port}" if client else "a client", request.method,
                   request.url.path)
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in a request handler")
        return APIError(500, f"internal server error: {type(exc).__name__}").response()
