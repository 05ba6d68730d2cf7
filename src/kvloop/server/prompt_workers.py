"""Request intake off the event loop: JSON parsing, chat templates and tokenization run on a
few worker threads, so a long prompt never stalls ``/health`` or the streams in flight.

The work is bounded twice: at most ``workers`` bodies are processed at once (the thread
pool's size), and at most ``max_backlog`` more wait for a thread. A request beyond that is
answered 429 with ``Retry-After`` at once instead of queueing without end (each waiting
request holds its body, up to ``--max-request-bytes``).

Threads help because the work either releases the GIL (the Rust ``tokenizers`` batch
encoder does for the whole encode) or is pure Python that the interpreter interleaves with
the loop every few milliseconds (jinja2 chat templates, pydantic).

:class:`BackgroundEncoder` runs the encode of a very long text (over ``LONG_TEXT_CHARS``) on
a thread at the lowest CPU priority (Linux), while the worker that asked waits: encoding
600 KB takes a core for a fraction of a second, and on a machine whose cores the engine's
step uses, two such encodes at normal priority made a stream's gaps 11x longer. Only the
encode, which holds no GIL, runs there: a low-priority thread holding the GIL would keep the
engine thread waiting for it while higher-priority threads take the cores.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from kvloop.priority import lowest_priority
from kvloop.server.errors import APIError

T = TypeVar("T")

DEFAULT_WORKERS = 2
"""Threads that encode prompts (the engine thread needs a core too)."""
DEFAULT_MAX_BACKLOG = 64
"""Requests that may wait for a prompt worker before new ones get 429."""
LONG_TEXT_CHARS = 131_072
"""Texts longer than this (about 32k tokens of English) are encoded at the lowest CPU
priority (``BackgroundEncoder``). NOTE: at nice 19 an encode gets a few percent of a core
that normal-priority threads keep busy (a 20 KB encode took 19x as long beside two busy
processes), so ordinary long prompts (RAG contexts of a few thousand tokens) stay at normal
priority."""


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


class BackgroundEncoder:
    """``tokenizer.encode`` for the prompt workers: a text over ``LONG_TEXT_CHARS`` is
    encoded on lowest-priority threads (one per prompt worker), the caller waiting for it;
    shorter ones on the caller's thread (module docstring). ``token_floor`` is the
    tokenizer's."""

    def __init__(self, tokenizer: Any, workers: int = DEFAULT_WORKERS) -> None:
        self.tokenizer = tokenizer
        self.token_floor = getattr(tokenizer, "token_floor", None)
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="kvloop-encode",
                                            initializer=lowest_priority)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) <= LONG_TEXT_CHARS:
            return self.tokenizer.encode(text, add_special_tokens)
        return self._executor.submit(self.tokenizer.encode, text, add_special_tokens).result()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
