"""``/dashboard``: the web view of the loop (``kvloop.viz.web``), live from the engine.

The page itself (HTML, CSS, JavaScript and the words for the records' codes) belongs to the
layer above (``kvloop.viz.web``): the command line hands it to ``install_dashboard``
(``kvloop.viz.web.live.dashboard_parts``).

The engine thread only appends each step's record to a bounded ring (``LiveRecorder``);
each open dashboard reads the ring from the event loop at most ``MAX_UPDATES_PER_S`` times a
second and sends the new records as one server-sent event. So an open dashboard costs the
engine one append a step, and a slow browser only ever delays its own events.

With an API key, the page and its events need the key (``Authorization: Bearer`` or, since
a browser's ``EventSource`` sends no headers, ``?key=``); the page's static files do not
(they hold no data). Prompt text is sent only when the server was started with
``--dashboard-show-prompts``; the page shows every text as text, never as markup.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Mapping
from typing import IO, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from kvloop.core.stats import StepRecord, StepRecorder
from kvloop.server.page_headers import SECURITY_HEADERS

MAX_UPDATES_PER_S = 10
"""Most server-sent events a dashboard gets a second."""
RING_STEPS = 512
"""Step records the server keeps for dashboards: enough for a new one's first ``FIRST_STEPS``
and for an open one's next event."""
FIRST_STEPS = 300
"""Recent steps a newly opened dashboard starts with."""
MAX_STEPS_PER_EVENT = 200
"""Most records one event carries (a burst beyond it: the newest)."""
KEEPALIVE_S = 15.0
"""Seconds without steps after which an event comment keeps the connection open."""
PROMPTS_KEPT = 256
"""Prompt texts remembered for the dashboard (``--dashboard-show-prompts``)."""


class LiveRecorder(StepRecorder):
    """A step recorder that keeps the last ``RING_STEPS`` records for dashboards (and still
    streams every record to ``sink``, as ``--trace-out`` asks)."""

    def __init__(self, *, sink: IO[str] | None = None, size: int = RING_STEPS) -> None:
        super().__init__(keep_in_memory=False, sink=sink)
        self._ring: deque[StepRecord] = deque(maxlen=size)
        self._count = 0
        """Records added in all."""
        # NOTE: held by the engine thread for one append, by a reader for one copy.
        self._lock = threading.Lock()

    def add(self, record: StepRecord) -> None:
        with self._lock:
            self._ring.append(record)
            self._count += 1
        if self.sink is not None:
            super().add(record)

    def since(self, count: int, limit: int) -> tuple[list[StepRecord], int]:
        """The records added after the first ``count`` (at most the last ``limit`` of
        them) and the new count."""
        with self._lock:
            total = self._count
            new = min(total - count, len(self._ring), limit)
            records = list(self._ring)[len(self._ring) - new:] if new > 0 else []
        return records, total


class PromptBook:
    """The prompt texts of recent requests, for ``--dashboard-show-prompts``."""

    def __init__(self, size: int = PROMPTS_KEPT) -> None:
        self.size = size
        self._texts: OrderedDict[str, str] = OrderedDict()
        self.count = 0

    def note(self, request_id: str, text: str | None) -> None:
        """Remember a request's prompt (called on the event loop, as requests arrive)."""
        if text is None:
            return
        self._texts[request_id] = text
        self.count += 1
        while len(self._texts) > self.size:
            self._texts.popitem(last=False)

    def latest(self, n: int) -> dict[str, str]:
        """The last ``n`` prompts noted (all kept ones if fewer)."""
        items = list(self._texts.items())
        return dict(items[-n:]) if n > 0 else {}

    def wrap(self, add_request: Callable[..., Any]) -> Callable[..., Any]:
        """``add_request`` that notes the request's prompt first."""
        def add(request_id: str, request: Any, **kwargs: Any) -> Any:
            stream = add_request(request_id, request, **kwargs)
            self.note(request_id, getattr(request, "prompt", None))
            return stream

        return add


def _authorized(request: Request, api_key: str | None) -> bool:
    if api_key is None:
        return True
    key = api_key.encode()
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key):
        return True
    return hmac.compare_digest(request.query_params.get("key", "").encode(), key)


def _refuse() -> Response:
    body = {"error": {"message": "invalid or missing API key (Authorization: Bearer ..., or "
                      "?key=... in the dashboard's URL)", "type": "invalid_request_error",
                      "param": None, "code": "invalid_api_key"}}
    return Response(json.dumps(body), status_code=401, media_type="application/json",
                    headers={"WWW-Authenticate": "Bearer", **SECURITY_HEADERS})


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _events(request: Request, recorder: LiveRecorder, source: str,
                  words: Mapping[str, Any], prompts: PromptBook | None) -> AsyncIterator[str]:
    records, seen = recorder.since(0, FIRST_STEPS)
    first: dict[str, Any] = {"source": source, "words": words,
                             "records": [r.to_dict() for r in records]}
    noted = 0
    if prompts is not None:
        first["prompts"] = prompts.latest(50)
        noted = prompts.count
    yield _event(first)
    idle = 0.0
    period = 1.0 / MAX_UPDATES_PER_S
    while not await request.is_disconnected():
        await asyncio.sleep(period)
        records, seen = recorder.since(seen, MAX_STEPS_PER_EVENT)
        payload: dict[str, Any] = {}
        if records:
            payload["records"] = [r.to_dict() for r in records]
        if prompts is not None and prompts.count != noted:
            payload["prompts"] = prompts.latest(min(50, prompts.count - noted))
            noted = prompts.count
        if payload:
            idle = 0.0
            yield _event(payload)
        else:
            idle += period
            if idle >= KEEPALIVE_S:
                idle = 0.0
                yield ": keepalive\n\n"


def install_dashboard(app: FastAPI, recorder: LiveRecorder, *, page: bytes,
                      files: Mapping[str, tuple[bytes, str]], words: Mapping[str, Any],
                      api_key: str | None, source: str, engine: Any = None,
                      show_prompts: bool = False) -> None:
    """Add ``/dashboard`` (``page``), its ``files`` (name -> bytes and content type) and
    ``/dashboard/events`` to ``app``; ``words`` go to each dashboard with its first event.

    ``engine``: the ``AsyncEngine`` whose request prompts are shown (``show_prompts``)."""
    prompts = PromptBook() if show_prompts else None
    if prompts is not None and engine is not None:
        engine.add_request = prompts.wrap(engine.add_request)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard(request: Request) -> Response:
        if not _authorized(request, api_key):
            return _refuse()
        return Response(page, media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)

    @app.get("/dashboard/events", include_in_schema=False)
    async def events(request: Request) -> Response:
        if not _authorized(request, api_key):
            return _refuse()
        return StreamingResponse(_events(request, recorder, source, words, prompts),
                                 media_type="text/event-stream",
                                 headers={**SECURITY_HEADERS, "X-Accel-Buffering": "no"})

    @app.get("/dashboard/{name}", include_in_schema=False)
    async def dashboard_file(name: str) -> Response:
        found = files.get(name)
        if found is None:
            body = {"error": {"message": f"no dashboard file {name!r}", "type": "not_found",
                              "param": None, "code": None}}
            return Response(json.dumps(body), status_code=404, media_type="application/json")
        return Response(found[0], media_type=found[1], headers=SECURITY_HEADERS)
