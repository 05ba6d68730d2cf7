"""The engine loop on a dedicated thread, and one async output stream per request.

HTTP handlers run on the event loop; ``LLMEngine.step()`` runs on the engine thread. They
meet in three places only:

* typed commands (add a ``ValidatedRequest``, abort, abort all) go to the engine thread
  through a deque guarded by a condition; the thread applies them between steps and sleeps
  on the condition when it has no work (no busy spinning; woken at least every
  ``IDLE_WAKE_S`` so that signal handlers run on ``kvloop serve``'s main thread);
* outputs come back once per step: the thread hands the step's whole batch to the event loop
  with one ``loop.call_soon_threadsafe``, which puts each output in its request's
  ``asyncio.Queue``;
* after every step the thread publishes an ``EngineStats`` snapshot (under the condition's
  lock) and feeds it to the metrics; the event loop reads that snapshot, never the engine.

So HTTP handling never waits on a model step, and a step never waits on HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvloop.engine.intake import EngineLimits, ValidatedRequest
from kvloop.engine.llm_engine import LLMEngine
from kvloop.engine.outputs import RequestOutput
from kvloop.engine.stats import EngineStats
from kvloop.errors import InvalidRequestError
from kvloop.server.streams import (
    EngineStoppedError,
    Item,
    QueueFullError,
    RequestAbortedError,
    RequestStream,
)

__all__ = [
    "AsyncEngine",
    "EngineStoppedError",
    "QueueFullError",
    "RequestAbortedError",
    "RequestStream",
]

logger = logging.getLogger("kvloop.server")

IDLE_WAKE_S = 0.05
"""Longest the idle engine loop sleeps before it looks again (and lets the main thread run
its signal handlers)."""


@dataclass(frozen=True, slots=True)
class AddCommand:
    """Queue a validated request in the engine."""

    request_id: str
    request: ValidatedRequest
    arrival_time: float


@dataclass(frozen=True, slots=True)
class AbortCommand:
    """Abort one request (a no-op if it already finished)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class AbortAllCommand:
    """Abort every request the engine holds."""


Command = AddCommand | AbortCommand | AbortAllCommand


class AsyncEngine:
    """Runs an ``LLMEngine`` on its own thread and streams outputs to asyncio handlers."""

    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_queued_requests: int | None = None,
        metrics: Any | None = None,
        on_caller_thread: bool = False,
    ) -> None:
        self.engine = engine
        """The engine; once started, only the engine thread touches it. The event loop uses
        the read-only ``limits``, ``tokenizer`` and ``clock`` below and the ``stats``
        snapshot."""
        self.limits: EngineLimits = engine.limits
        """What every request must fit (immutable)."""
        self.tokenizer: Any | None = engine.tokenizer
        """The engine's tokenizer, for encoding on the event loop (None: token ids only)."""
        self.clock = engine.clock
        """The engine's clock (arrival times are on it)."""
        self.default_sampling: dict[str, Any] = dict(engine.default_sampling)
        """Sampling fields a request leaves unset default to (the model's generation
        config; empty: vLLM's neutral defaults)."""
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics
        """A ``ServerMetrics`` (or None): told about every step and every output."""
        self._cond = threading.Condition()
        # NOTE: guarded by ``_cond``: _commands, _pending_adds, _stats, _stopping.
        self._commands: deque[Command] = deque()
        self._pending_adds = 0
        """Adds not yet applied by the engine thread (they count as waiting)."""
        self._stats: EngineStats = engine.stats()  # NOTE: no thread runs the engine yet
        """The engine's latest snapshot, published by the engine thread."""
        self._stopping = False
        self._streams: dict[str, RequestStream] = {}
        """Unfinished streams by request id (event loop only)."""
        self._live: set[str] = set()
        """Requests the engine holds (engine thread only)."""
        self._thread: threading.Thread | None = None
        self.on_caller_thread = on_caller_thread
        """The loop runs on the thread that calls :meth:`run_here` (``kvloop serve``'s main
        thread), not on a thread of its own."""
        self._host_go = threading.Event()
        self._host_done = threading.Event()
        self._running = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.draining = False
        """Set on SIGTERM/SIGINT: new requests are refused, running ones finish."""

    # -- lifecycle (event loop) ------------------------------------------------------------
    def start(self) -> None:
        """Start the engine loop; call from the event loop that will consume outputs. The
        loop runs on a thread of its own, or on the thread waiting in :meth:`run_here`."""
        self._loop = asyncio.get_running_loop()
        if self.on_caller_thread:
            self._running = True  # NOTE: before the host wakes: requests may come at once
            self._host_go.set()
            return
        self._thread = threading.Thread(target=self._run, name="kvloop-engine", daemon=True)
        self._thread.start()

    def run_here(self, wait_while: Callable[[], bool] = lambda: True) -> None:
        """Run the engine loop on the calling thread once :meth:`start` ran on the event
        loop (its lifespan); return when the engine stops, or at once when ``wait_while()``
        turns False before :meth:`start` (the server never came up).

        NOTE: for ``kvloop serve``'s main thread: on CPU, torch's OpenMP regions cost much
        more when entered from a thread other than the main one (a 60-100 µs op took
        1.6-2x as long in a measured A/B), which at batch 1 added 10 ms to a 14 ms decode
        step; uvicorn's event loop then runs on another thread."""
        if not self.on_caller_thread:
            raise RuntimeError("run_here needs AsyncEngine(..., on_caller_thread=True)")
        while not self._host_go.wait(0.1):
            if not wait_while():
                return
        try:
            if not self._stopping:
                self._run()
        finally:
            self._running = False
            self._host_done.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still unfinished are aborted."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self.on_caller_thread:
            self._host_go.set()
            self._host_done.wait(timeout)
        elif self._thread is not None:
            self._thread.join(timeout)

    @property
    def started(self) -> bool:
        """Whether :meth:`start` ran (the engine thread was started, alive or not)."""
        return self._thread is not None

    @property
    def is_alive(self) -> bool:
        if self.on_caller_thread:
            return self._running
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_active(self) -> int:
        """Requests added and not yet finished (event loop's view)."""
        return len(self._streams)

    @property
    def stats(self) -> EngineStats:
        """The engine's latest snapshot (taken by the engine thread after its last step)."""
        with self._cond:
            return self._stats

    # -- requests (event loop) -----------------------------------------------------------
    def add_request(
        self, request_id: str, request: ValidatedRequest, *, arrival_time: float | None = None
    ) -> RequestStream:
        """Queue a validated request (``LLMEngine.validate`` / ``intake.validate_request``);
        raises InvalidRequestError (id in use), QueueFullError or EngineStoppedError and then
        leaves everything untouched."""
        if self.draining or not self.is_alive:
            raise EngineStoppedError("the server is draining (shutting down)" if self.draining
                                     else "the engine is not running")
        if request_id in self._streams:
            raise InvalidRequestError("request_id", f"request_id {request_id!r} is already "
                                      "in use")
        arrival = arrival_time if arrival_time is not None else self.clock()
        stream = RequestStream(request_id, self.abort, request.params.n)
        with self._cond:
            limit = self.max_queued_requests
            # NOTE: waiting = the last snapshot's queue + adds the engine thread has not
            # applied yet. Adds applied at the start of the step in flight are in neither
            # until that step ends, so the limit may be passed by one step's adds (a soft
            # limit, like vLLM's); nothing here reads the scheduler across threads.
            if limit is not None and self._stats.num_waiting + self._pending_adds >= limit:
                raise QueueFullError(
                    f"the waiting queue is full ({limit} requests); retry later"
                )
            self._commands.append(AddCommand(request_id, request, arrival))
            self._pending_adds += 1
            self._cond.notify()
        self._streams[request_id] = stream
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request at the engine's next step boundary; its blocks return to the pool."""
        self._streams.pop(request_id, None)
        self._submit(AbortCommand(request_id))

    def abort_all(self) -> None:
        """Abort every request; their streams end with ``RequestAbortedError``."""
        self._submit(AbortAllCommand())

    def _submit(self, command: Command) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def _deliver(self, batch: list[tuple[str, Item]]) -> None:
        """On the event loop: route one step's outputs to their streams."""
        streams = self._streams
        for rid, item in batch:
            stream = streams.get(rid)
            if stream is None:
                continue  # aborted by its client meanwhile
            if stream.put(item):
                del streams[rid]

    # -- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        cond = self._cond
        while True:
            with cond:
                # NOTE: never an unbounded wait. Python runs signal handlers on the main
                # thread only, between bytecodes; a signal whose C handler ran just before
                # this thread blocked (or on another thread) would otherwise wait for the
                # next request, so ``kvloop serve`` (whose main thread runs this loop) would
                # miss a SIGTERM that arrives as it goes idle.
                while not (self._commands or self._stopping or engine.has_unfinished_requests()):
                    cond.wait(IDLE_WAKE_S)
                commands = list(self._commands)
                self._commands.clear()
                if self._stopping:
                    break
            batch: list[tuple[str, Item]] = []
            try:
                self._apply(commands, batch)
                if engine.has_unfinished_requests():
                    self._collect(engine.step(), batch)
            except Exception as exc:  # a bug outside the model step (the engine isolates those)
                logger.exception("engine loop error; failing every unfinished request")
                self._fail_all(batch, RequestAbortedError(f"engine loop error: {exc!r}", 500))
            self._publish()
            self._send(batch)
        # NOTE: every stream gets a last item, so no handler waits forever: requests in the
        # engine and adds that never reached it end with an error.
        batch = [(c.request_id, RequestAbortedError("the server shut down"))
                 for c in commands if isinstance(c, AddCommand)]
        self._fail_all(batch, RequestAbortedError("the server shut down"))
        self._send(batch)

    def _apply(self, commands: list[Command], batch: list) -> None:
        """Apply commands in order; each one's failure stays its own."""
        num_adds = 0
        try:
            for cmd in commands:
                if isinstance(cmd, AddCommand):
                    num_adds += 1
                    self._add(cmd, batch)
                elif isinstance(cmd, AbortAllCommand):
                    self._fail_all(batch, RequestAbortedError("the server aborted the request"))
                else:
                    self._abort(cmd.request_id)
        finally:
            if num_adds:
                with self._cond:
                    self._pending_adds -= num_adds

    def _add(self, cmd: AddCommand, batch: list) -> None:
        try:
            self.engine.add_request(cmd.request_id, cmd.request, arrival_time=cmd.arrival_time)
        except ValueError as exc:
            batch.append((cmd.request_id, exc))
        except Exception as exc:
            logger.exception("engine error adding request %s", cmd.request_id)
            batch.append((cmd.request_id, RequestAbortedError(f"engine error: {exc!r}", 500)))
        else:
            self._live.add(cmd.request_id)

    def _collect(self, outputs: list[RequestOutput], batch: list) -> None:
        metrics = self.metrics
        now = time.monotonic()
        for out in outputs:
            if metrics is not None:
                metrics.observe_output(out, now)
            if out.finished and not self.engine.has_request(out.request_id):
                self._live.discard(out.request_id)  # NOTE: every sequence of it is done
            batch.append((out.request_id, out))

    def _abort(self, request_id: str) -> None:
        self._live.discard(request_id)
        try:
            out = self.engine.abort_request(request_id)
        except Exception:
            logger.exception("engine error aborting request %s", request_id)
            return
        if out is not None and self.metrics is not None:
            self.metrics.observe_output(out, time.monotonic())

    def _fail_all(self, batch: list, error: BaseException) -> None:
        for rid in list(self._live):
            self._abort(rid)
            batch.append((rid, error))

    def _publish(self) -> None:
        """Hand the engine's snapshot to the event loop's side and to the metrics."""
        stats = self.engine.stats()
        with self._cond:
            self._stats = stats
        if self.metrics is not None:
            self.metrics.observe_stats(stats)

    def _send(self, batch: list[tuple[str, Item]]) -> None:
        if batch and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, batch)
