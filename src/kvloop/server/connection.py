"""Limits on what a connection may send before the app sees a request: uvicorn's httptools
protocol with a header size limit and header and body read timeouts.

uvicorn bounds neither: a 64 MB header was read (and answered 200 after 13 s), and
connections that sent their headers or body a byte at a time, or declared a body and never
sent it, were held open without end. Here, per connection:

* **headers**: at most ``max_header_bytes`` (request line and header fields), else 431 and
  close, before the app runs; they must arrive within ``header_timeout_s`` of the
  connection opening or of the request's first byte, else 408 and close (uvicorn's own
  keep-alive timeout still closes a connection idle between requests);
* **body**: it must arrive within ``body_timeout_s`` of the headers plus one second per
  ``BODY_MIN_RATE`` bytes received (so a large upload at a sane rate is never cut, a
  trickle is), else 408 and close. The app's pending ``request.body()`` then sees a
  disconnect (``errors.py`` logs one line; scope key ``BODY_TIMEOUT_KEY`` says why).

A refusal is one INFO line, never a traceback, and never written into another request's
response: a pipelined request's body is timed from the moment it is served, its headers'
timer waits while the request before it is in flight, and time with reading paused by
uvicorn itself (a full buffer) is never held against the client.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from kvloop.server.errors import error_body
from kvloop.server.limits import BODY_MIN_RATE, BODY_TIMEOUT_KEY, ConnectionLimits

logger = logging.getLogger("kvloop.server")

def protocol_class(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's ``http`` protocol class that enforces ``limits`` (``uvicorn.Config(http=)``)."""
    return type("LimitedHttpProtocol", (LimitedHttpProtocol,), {"limits": limits})


class LimitedHttpProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` with the module docstring's limits (``protocol_class`` sets
    ``limits``)."""

    limits: ConnectionLimits = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_headers = True
        """Between a request's first byte (or the connection opening) and its headers' end."""
        self._header_bytes = 0
        self._body_start = 0.0
        self._body_bytes = 0
        self._timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._completed_headers = False
        """A request's headers ended in the read being parsed."""

    # -- the connection ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s, self._header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        was_in_headers = self._in_headers
        self._completed_headers = False
        super().data_received(data)
        # NOTE: only a read in which no request's headers ended is all header bytes; headers
        # that end in a read are measured exactly in ``on_headers_complete``.
        if was_in_headers and not self._completed_headers and not self._refused:
            self._header_bytes += len(data)
            if self._header_bytes > self.limits.max_header_bytes:
                self._refuse(431, self._too_large())

    # -- parser callbacks ----------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._refused:
            return
        super().on_message_begin()
        self._in_headers = True
        self._header_bytes = 0
        if self._timer is None:
            self._arm(self.limits.header_timeout_s, self._header_timeout)

    def on_url(self, url: bytes) -> None:
        if not self._refused:
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._refused:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.limits.max_header_bytes:
            self._refuse(431, self._too_large())
            return
        self._in_headers = False
        self._completed_headers = True
        self._disarm()
        self._body_bytes = 0
        # NOTE: the body timer starts with the request's ASGI task (``_start_asgi_task``): a
        # pipelined request waits behind the one in flight and is not timed meanwhile.
        super().on_headers_complete()

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        super()._start_asgi_task(cycle, app)
        if cycle.more_body and cycle is self.cycle:
            # NOTE: disarmed by ``on_message_complete``
            self._body_start = self.loop.time()
            self._arm(self.limits.body_timeout_s, self._body_timeout)

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            self._body_bytes += len(body)
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._disarm()
        super().on_message_complete()

    # -- timeouts ------------------------------------------------------------------------
    def _arm(self, delay: float, callback: Callable[[], None]) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _header_timeout(self) -> None:
        self._timer = None
        busy = self.cycle is not None and not self.cycle.response_complete
        if busy or (self.flow is not None and self.flow.read_paused):
            # NOTE: a pipelined request behind one in flight (never a refusal written into
            # another response), or our own pause: not the client's delay.
            self._arm(self.limits.header_timeout_s, self._header_timeout)
            return
        self._refuse(408, f"the request headers did not arrive within "
                     f"{self.limits.header_timeout_s:g} s (--header-timeout)")

    def _body_timeout(self) -> None:
        self._timer = None
        limits = self.limits
        deadline = self._body_start + limits.body_timeout_s + self._body_bytes / BODY_MIN_RATE
        now = self.loop.time()
        if self.flow is not None and self.flow.read_paused:
            # NOTE: our pause (a full buffer), not the client's delay: its clock restarts
            self._body_start = now
            self._arm(limits.body_timeout_s, self._body_timeout)
            return
        if now < deadline:
            self._arm(max(deadline - now, 0.05), self._body_timeout)
            return
        if self.cycle is not None:
            self.cycle.scope[BODY_TIMEOUT_KEY] = True  # type: ignore[typeddict-unknown-key]
            self.cycle.keep_alive = False
            if self.cycle.response_started:  # NOTE: the app answered already: just close
                self._close(None, "")
                return
        self._refuse(408, f"the request body did not arrive in time ({self._body_bytes} bytes "
                     f"in {now - self._body_start:.0f} s; --body-timeout "
                     f"{limits.body_timeout_s:g} s plus 1 s per {BODY_MIN_RATE} bytes)")

    def _too_large(self) -> str:
        return (f"the request headers are larger than this server's limit of "
                f"{self.limits.max_header_bytes} bytes (--max-header-bytes)")

    # -- refusing ------------------------------------------------------------------------
    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with an OpenAI error body and close the connection."""
        self._refused = True
        self._disarm()
        self._close(status, message)

    def _close(self, status: int | None, message: str) -> None:
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        logger.info("closing the connection of %s: %s", client, message or "body timeout")
        if status is not None and not self.transport.is_closing():
            body = json.dumps(error_body(status, message), separators=(",", ":")).encode()
            self.transport.write(b"".join([
                STATUS_LINE[status], b"content-type: application/json\r\n",
                b"content-length: ", str(len(body)).encode(), b"\r\n",
                b"connection: close\r\n\r\n", body]))
        self.transport.close()
