"""What one HTTP connection may send, and how slowly: the settings ``connection.py``
enforces (a module of its own so that the command line reads them without importing
uvicorn)."""

from __future__ import annotations

from dataclasses import dataclass

BODY_MIN_RATE = 1024
"""Bytes per second a request body must keep up, past ``body_timeout_s``."""
BODY_TIMEOUT_KEY = "kvloop.body_timeout"
"""Set (True) in the ASGI scope of a request whose body the server stopped waiting for."""


@dataclass(frozen=True)
class ConnectionLimits:
    """What one HTTP connection may send, and how slowly (``kvloop serve`` flags)."""

    max_header_bytes: int = 64 << 10
    """Largest request line plus header fields (bytes): larger is a 431
    (``--max-header-bytes``; nginx allows 4 x 8 KiB, Node.js 16 KiB)."""
    header_timeout_s: float = 10.0
    """Seconds the headers may take to arrive in full (``--header-timeout``)."""
    body_timeout_s: float = 30.0
    """Seconds the body may take, plus one per ``BODY_MIN_RATE`` bytes received
    (``--body-timeout``)."""

    def __post_init__(self) -> None:
        if self.max_header_bytes < 1024:
            raise ValueError("--max-header-bytes must be >= 1024, got "
                             f"{self.max_header_bytes}")
        for flag, value in (("--header-timeout", self.header_timeout_s),
                            ("--body-timeout", self.body_timeout_s)):
            if not 0 < value < float("inf"):
                raise ValueError(f"{flag} must be a positive number of seconds, got {value}")
