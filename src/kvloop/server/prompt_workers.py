"""Request intake off the event loop: JSON parsing, chat templates and tokenization run on a
few worker threads, so a long prompt never stalls ``/health`` or the streams in flight.

The work is bounded twice: at most ``workers`` bodies are processed at once (the thread
pool's size), and at most ``max_backlog`` more wait for a thread. A request beyond that is
answered 429 with ``Retry-After`` at once instead of queueing without end (each waiting
request holds its body, up to ``--max-request-bytes``).

Threads help because the work either releases the GIL (the Rust ``tokenizers`` encoder does
for the whole encode) or is pure Python that the interpreter interleaves with the loop every
few milliseconds (jinja2 chat templates, pydantic on small bodies).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from kvloop.server.errors import APIError

T = TypeVar("T")

DEFAULT_WORKERS = 2
"""Threads that encode prompts (the engine thread needs a core too)."""
DEFAULT_MAX_BACKLOG = 64
"""Requests that may wait for a prompt worker before new ones get 429."""


class PromptWorkers:
    """A small thread pool for request intake with a bounded backlog (module docstring)."""

    def __init__(self, workers: int = DEFAULT_WORKERS,
                 max_backlog: int = DEFAULT_MAX_BACKLOG) -> None:
        if workers < 1 or max_backlog < 0:
            raise ValueError("PromptWorkers needs workers >= 1 and max_backlog >= 0")
        self.workers = workers
        self.max_backlog = max_backlog
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="kvloop-prompt")
        self._lock = threading.Lock()
        self._in_flight = 0
        """Submitted and not yet done (running or waiting for a thread); under ``_lock``."""

    @property
    def in_flight(self) -> int:
        """Requests being processed or waiting for a worker."""
        with self._lock:
            return self._in_flight

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on a worker thread; 429 ``APIError`` when the backlog is full.

        If the caller is cancelled, work not yet started is dropped; work already running
        finishes on its thread (a tokenizer cannot be interrupted) and still counts until then.
        """
        with self._lock:
            if self._in_flight >= self.workers + self.max_backlog:
                raise APIError(429, "the server is busy encoding prompts "
                               f"({self._in_flight} in progress or waiting); retry later")
            self._in_flight += 1
        try:
            future = self._executor.submit(fn)
        except RuntimeError:  # shut down
            self._done(None)
            raise APIError(503, "the server is shutting down") from None
        future.add_done_callback(self._done)
        return await asyncio.wrap_future(future)

    def _done(self, _: Future | None) -> None:
        with self._lock:
            self._in_flight -= 1

    def shutdown(self) -> None:
        """Drop waiting work and let running work end on its own (never blocks)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
