"""A uvicorn server whose first SIGTERM/SIGINT drains the engine before exiting.

On the first signal new requests get 503 at once, running ones finish (at most
``timeout`` seconds, then they are aborted) and the process exits 0. A second signal
aborts what is left and exits 130 (128 + SIGINT: interrupted, as a shell reports it).
``aborted`` counts the requests a timeout or a second signal cut short.
"""

from __future__ import annotations

import logging
import time
from types import FrameType

import uvicorn

from kvloop.server.engine_client import EngineClient

logger = logging.getLogger("kvloop.server")


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` with the drain described in the module docstring."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient, timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = timeout
        self.drain_deadline: float | None = None
        self.aborted = 0
        """Requests aborted by the shutdown timeout or a second signal."""
        self.forced = False
        """A second signal ended the drain."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: replaces uvicorn's handler, which re-raises the signal after shutdown (the
        # process would then die by the signal instead of exiting 0).
        if self.drain_deadline is None:
            logger.info("signal %d: draining (no new requests; %d running, at most %.0f s)",
                        sig, self.engine.num_active, self.drain_timeout)
            self.engine.draining = True
            self.drain_deadline = time.monotonic() + self.drain_timeout
        else:
            logger.warning("second signal: aborting %d requests", self.engine.num_active)
            self.forced = True
            self._abort_all()

    async def on_tick(self, counter: int) -> bool:
        # NOTE: uvicorn calls this every 0.1 s on the event loop; the drain ends here.
        deadline = self.drain_deadline
        if deadline is not None and not self.should_exit:
            if self.engine.num_active == 0:
                logger.info("drained; shutting down")
                self.should_exit = True
            elif time.monotonic() >= deadline:
                logger.warning("shutdown timeout: aborting %d requests", self.engine.num_active)
                self._abort_all()
        return await super().on_tick(counter)

    def _abort_all(self) -> None:
        self.aborted += self.engine.num_active
        self.engine.abort_all()
        self.should_exit = True
