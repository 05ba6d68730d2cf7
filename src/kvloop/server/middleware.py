"""Pure ASGI middleware that answers before a route (or a body) is ever read.

* :class:`APIKeyMiddleware`: with ``--api-key``, every request under ``/v1`` needs the key,
  whatever its path or method, so that unknown paths and wrong methods answer 401 rather
  than 404/405 (no probing the API without a key).
* :class:`HeadAsGetMiddleware`: ``HEAD`` wherever ``GET`` is allowed (``/health`` for load
  balancers' probes): the request runs as a ``GET``, and uvicorn sends only its headers.
* :class:`BodyLimitMiddleware`: ``--max-request-bytes``. A ``Content-Length`` over the limit
  is answered 413 before one byte of the body is read; a body without one (chunked) is
  counted as it streams in and the request ends with 413 as soon as it passes the limit, so
  at most ``limit`` bytes (plus one network read) are ever held. uvicorn then reads and
  discards whatever the client still sends on that connection (constant memory), so the
  client sees the 413 instead of a reset connection.

Both answer in OpenAI's error shape (``errors.error_body``).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvloop.server import DEFAULT_MAX_REQUEST_BYTES
from kvloop.server.errors import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "APIKeyMiddleware", "BodyLimitMiddleware",
           "HeadAsGetMiddleware", "RequestTooLargeError"]


class RequestTooLargeError(APIError):
    """A request body over ``--max-request-bytes`` (413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than this server's limit of "
                         f"{limit} bytes (--max-request-bytes)")


async def send_error(send: Send, error: APIError) -> None:
    """Send ``error`` as a whole JSON response."""
    # NOTE: compact, as FastAPI's own JSON responses: one error format on every route.
    body = json.dumps(error.body(), separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1"))
                for k, v in error.response_headers().items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


class APIKeyMiddleware:
    """401 for any request under ``/v1`` without ``Authorization: Bearer <api_key>``."""

    def __init__(self, app: ASGIApp, api_key: str, prefix: str = "/v1") -> None:
        self.app = app
        self.key = api_key.encode()
        self.prefix = prefix

    def authorized(self, scope: Scope) -> bool:
        """True when the request carries the key (compared in constant time)."""
        scheme, _, token = (_header(scope, b"authorization") or b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        guarded = path == self.prefix or path.startswith(self.prefix + "/")
        if scope["type"] != "http" or not guarded or self.authorized(scope):
            await self.app(scope, receive, send)
            return
        await send_error(send, APIError(
            401, "invalid or missing API key (Authorization: Bearer ...)"))


class HeadAsGetMiddleware:
    """``HEAD`` answered as ``GET`` without its body (see the module docstring).

    NOTE: the app gets a copy of the scope whose method is ``GET``; uvicorn's own scope
    still says ``HEAD``, so it sends the headers (``content-length`` included) and drops
    the body. A path without ``GET`` answers 405, as for any method it does not allow."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "HEAD":
            scope = {**scope, "method": "GET"}
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a request body over ``max_bytes`` (see the module docstring)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            await send_error(send, RequestTooLargeError(limit))
            return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # NOTE: the route's ``await request.body()`` raises this; the app's
                    # APIError handler answers 413 (and ``__call__`` below if none did).
                    raise RequestTooLargeError(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except RequestTooLargeError as exc:
            if started:
                raise
            await send_error(send, exc)
