"""The FastAPI app: OpenAI routes, ``/health``, ``/version``, ``/metrics``.

``create_app`` takes an ``AsyncEngine`` that is not started yet; the app's lifespan starts
its thread (and the periodic stats line) and stops it on shutdown.

A request meets, in order: the connection's limits on header size and on how slowly headers
and body may arrive (431, 408: ``connection.py``, in uvicorn's protocol), ``HEAD`` answered
as ``GET``, the API key check for anything under ``/v1`` (401), the body-size limit (413,
``middleware.py``), the drain check (503), then its body is read and handed to a
prompt worker thread that parses, templates, tokenizes and validates it
(``prompt_workers.py``: 429 when too many wait) before the engine thread gets it. The event
loop itself only moves bytes, so ``/health`` and the streams in flight never wait on a
tokenizer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

import kvloop
from kvloop.server import errors, openapi
from kvloop.server.engine_client import EngineClient
from kvloop.server.errors import CLIENT_CLOSED, APIError
from kvloop.server.metrics import ServerMetrics
from kvloop.server.middleware import (
    DEFAULT_MAX_REQUEST_BYTES,
    APIKeyMiddleware,
    BodyLimitMiddleware,
    HeadAsGetMiddleware,
)
from kvloop.server.prompt_workers import DEFAULT_MAX_BACKLOG, DEFAULT_WORKERS, PromptWorkers
from kvloop.server.protocol import ChatCompletionRequest, CompletionRequest
from kvloop.server.serving import Job, OpenAIServing
from kvloop.server.stats_logger import StatsLogger


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
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES
    """Largest request body (bytes) taken; larger ones get 413 before they are read
    (None or 0: no limit)."""
    prompt_workers: int = DEFAULT_WORKERS
    """Threads that parse, template and tokenize request bodies."""
    max_prompt_backlog: int = DEFAULT_MAX_BACKLOG
    """Bodies that may wait for a prompt worker; more get 429 with ``Retry-After``."""


class HealthStatus(BaseModel):
    """The body of a healthy ``/health``: ``{"status": "ok"}``."""

    status: str = "ok"


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


def create_app(engine: EngineClient, metrics: ServerMetrics, config: ServerConfig, *,
               render_metrics: Callable[[], Awaitable[bytes]] | None = None) -> FastAPI:
    """The OpenAI-compatible app over ``engine`` (started and stopped by its lifespan).

    ``render_metrics`` replaces ``metrics.render`` for ``/metrics`` (the Ray ingress merges
    its replicas' registries); ``engine`` is an ``AsyncEngine`` or a
    ``kvloop.cluster.ray_serve.ClusterEngine`` (``EngineClient``)."""
    serving = OpenAIServing(engine, config.served_model_name, config.prompt_workers)
    workers = PromptWorkers(config.prompt_workers, config.max_prompt_backlog)

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
            workers.shutdown()
            if serving.encoder is not None:
                serving.encoder.shutdown()
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="kvloop", version=kvloop.__version__, lifespan=lifespan,
                  description="kvloop's OpenAI-compatible API. Every error answers "
                  "{\"error\": {\"message\", \"type\", \"param\", \"code\"}}.")
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.serving = serving
    app.state.prompt_workers = workers
    errors.install(app)
    openapi.install(app, api_key=config.api_key is not None)
    # NOTE: the last added runs first: the key is checked before the size of the body.
    if config.max_request_bytes:
        app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    if config.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    app.add_middleware(HeadAsGetMiddleware)

    def admit() -> None:
        if engine.draining:
            raise APIError(503, "the server is draining (shutting down) and takes no new requests")

    async def run(request: Request, job: Job) -> Response:
        stream = serving.submit(job)
        if job.stream:
            return _EngineStreamingResponse(serving.stream(job, stream), stream.abort)
        done, body = await run_until_disconnect(request, serving.collect(job, stream))
        if not done:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(body)

    post_errors = openapi.errors(400, 401, 404, 413, 429, 500, 503)

    @app.post("/v1/completions", responses={**openapi.STREAMED_OR_JSON, **post_errors},
              openapi_extra=openapi.request_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        """Complete a prompt (OpenAI's legacy completions API)."""
        arrival = engine.clock()
        admit()
        body = await request.body()
        return await run(request, await workers.run(
            lambda: serving.completion_job(body, arrival)))

    @app.post("/v1/chat/completions", responses={**openapi.STREAMED_OR_JSON, **post_errors},
              openapi_extra=openapi.request_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        """Answer a conversation through the model's chat template."""
        arrival = engine.clock()
        admit()
        body = await request.body()
        return await run(request, await workers.run(lambda: serving.chat_job(body, arrival)))

    @app.get("/v1/models", responses=openapi.errors(401, 413))
    async def models() -> dict[str, Any]:
        """The one model served."""
        return {"object": "list", "data": [{
            "id": config.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "kvloop", "root": config.model_root, "parent": None,
            "max_model_len": serving.max_model_len,
        }]}

    @app.get("/health", responses={200: {"model": HealthStatus},
                                   **openapi.errors(413, 503)})
    async def health() -> Response:
        """200 `{"status": "ok"}` while the server takes requests; 503 once it drains (after
        SIGTERM/SIGINT) or when its engine is not running, so that load balancers stop
        sending traffic. (The docstring is the OpenAPI description: Markdown.)"""
        if engine.draining:
            raise APIError(503, "the server is draining (shutting down) and takes no new requests")
        if not engine.is_alive:
            raise APIError(503, "the engine is not running")
        return JSONResponse({"status": "ok"})

    @app.get("/version", responses=openapi.errors(413))
    async def version() -> dict[str, str]:
        """kvloop's version."""
        return {"version": kvloop.__version__}

    @app.get("/metrics", response_class=PlainTextResponse, responses=openapi.errors(413))
    async def prometheus() -> Response:
        """Prometheus metrics (vLLM's names with a `kvloop:` prefix)."""
        body = await render_metrics() if render_metrics is not None else metrics.render()
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return app
