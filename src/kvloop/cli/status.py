"""kvloop's start-up status lines on stderr, for the commands that load a model."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import IO, Any


class _StatusHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes ``kvloop: message`` to whatever ``sys.stderr`` is at each line."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("kvloop: %(message)s"))

    @property  # type: ignore[override]
    def stream(self) -> IO[str]:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


@contextlib.contextmanager
def status_to_stderr() -> Iterator[None]:
    """Send kvloop's INFO status lines (start-up phases) to stderr as ``kvloop: ...`` while
    the block runs, and only there (not also to a handler of the root logger, such as
    ``kvloop serve``'s)."""
    log = logging.getLogger("kvloop")
    handler, level, propagate = _StatusHandler(), log.level, log.propagate
    log.addHandler(handler)
    log.propagate = False
    if level == logging.NOTSET or level > logging.INFO:
        log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate
