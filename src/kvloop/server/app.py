"""The FastAPI app: OpenAI routes, ``/health``, ``/version``, ``/metrics``.

``create_app`` takes an ``AsyncEngine`` that is not started yet; the app's lifespan starts
its thread (and the periodic stats line) and stops it on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

import kvloop
from kvloop.server import errors
from kvloop.server.async_engine import AsyncEngine
from kvloop.server.errors import APIError
from kvloop.server.metrics import ServerMetrics
from kvloop.server.protocol import ChatCompletionRequest, CompletionRequest, parse
from kvloop.server.serving import Job, OpenAIServing
from kvloop.server.stats_logger import StatsLogger

CLIENT_CLOSED = 499
"""Status logged for a request whose client went away (nothing is sent)."""


@dataclass
class ServerConfig:
    """What the HTTP layer needs besides the engine."""

    served_model_name: str
    model_root: str = ""
    """Shown as ``root`` in ``/v1/models``."""
    api_key: str | None = None
    """When set, ``/v1/*`` needs ``Authorization: Bearer <api_key>``."""
    log_interval: float = 10.0
    """Seconds between stats lines (0: never)."""


class _EngineStreamingResponse(StreamingResponse):
    """A streaming response that aborts its request however the response ends (even when the
    client disconnects before the body generator ever started)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def run_until_disconnect(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Await ``work`` unless the client disconnects first (then ``work`` is cancelled).

    Returns (completed, result)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # cannot watch this connection: let the work run to its end
            await asyncio.Event().wait()

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler itself is cancelled
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return False, None
    return True, task.result()


def create_app(engine: AsyncEngine, metrics: ServerMetrics, config: ServerConfig) -> FastAPI:
    """The OpenAI-compatible app over ``engine`` (started and stopped by its lifespan)."""
    serving = OpenAIServing(engine, config.served_model_name)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        logger_task = None
        if config.log_interval > 0:
            logger_task = asyncio.create_task(StatsLogger(metrics, config.log_interval).run())
        try:
            yield
        finally:
            if logger_task is not None:
                logger_task.cancel()
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="kvloop", version=kvloop.__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.serving = serving
    errors.install(app)

    def authorize(request: Request) -> None:
        if config.api_key is not None:
            auth = request.headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), config.api_key.encode()
            ):
                raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)")

    def admit(request: Request) -> None:
        authorize(request)
        if engine.draining:
            raise APIError(503, "the server is shutting down and takes no new requests")

    async def run(request: Request, job: Job) -> Response:
        stream = serving.submit(job)
        if job.stream:
            return _EngineStreamingResponse(serving.stream(job, stream), stream.abort)
        done, body = await run_until_disconnect(request, serving.collect(job, stream))
        if not done:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(body)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = engine.clock()
        admit(request)
        req = parse(CompletionRequest, await request.body())
        return await run(request, serving.prepare_completion(req, arrival))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = engine.clock()
        admit(request)
        req = parse(ChatCompletionRequest, await request.body())
        return await run(request, serving.prepare_chat(req, arrival))

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        return {"object": "list", "data": [{
            "id": config.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "kvloop", "root": config.model_root, "parent": None,
            "max_model_len": serving.max_model_len,
        }]}

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            raise APIError(503, "the engine is not running")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": kvloop.__version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
