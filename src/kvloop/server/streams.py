"""One request's output stream on the event loop, and the errors a stream can end with."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvloop.engine.outputs import RequestOutput

Item = RequestOutput | BaseException


class QueueFullError(Exception):
    """The waiting queue is at ``max_queued_requests``."""


class EngineStoppedError(Exception):
    """The engine no longer takes requests (shutting down, or its thread is gone)."""


class RequestAbortedError(Exception):
    """The server ended a request: 503 when shutting down, 500 after an engine loop error."""

    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.status = status


class RequestStream:
    """The outputs of one request, in order, for the event loop (an async iterator).

    Each ``RequestOutput`` carries the deltas of one step (``new_text``, ``new_token_ids``)
    and, when logprobs were asked for, only the new tokens' ``logprobs``.
    """

    def __init__(self, request_id: str, abort: Callable[[str], None], n: int = 1) -> None:
        self.request_id = request_id
        self.finished = False
        self._abort = abort
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        self._unfinished_in = n
        """Sequences whose final output was not put yet (``SamplingParams.n``)."""
        self._unfinished_out = n
        """Sequences whose final output was not read yet."""

    def put(self, item: Item) -> bool:
        """Called on the event loop by the engine's delivery callback; True once the
        request is over (an error, or every sequence's final output)."""
        self._queue.put_nowait(item)
        if isinstance(item, BaseException):
            return True
        if item.finished:
            self._unfinished_in -= 1
        return self._unfinished_in <= 0

    @property
    def ready(self) -> bool:
        """Whether the next item is already queued (``__anext__`` will not wait)."""
        return not self.finished and not self._queue.empty()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self._unfinished_out -= 1
            self.finished = self._unfinished_out <= 0
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)
