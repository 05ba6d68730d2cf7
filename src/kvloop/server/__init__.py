"""The OpenAI-compatible server: ``kvloop serve`` (see ``command.py``).

Importing this package is cheap; FastAPI and uvicorn load with the modules that need them.
"""

from __future__ import annotations

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "AsyncEngine", "ServerConfig", "ServerMetrics",
           "create_app"]

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
"""``--max-request-bytes``' default: 1 MiB, the request-body limit of nginx and many other
proxies. English text that fills the default model's 8,192 tokens is ~40 KB of JSON; a
long-context model (100k+ tokens, or such prompts as token ids) needs a larger limit."""


def __getattr__(name: str) -> object:
    if name == "AsyncEngine":
        from kvloop.server.async_engine import AsyncEngine

        return AsyncEngine
    if name in ("ServerConfig", "create_app"):
        from kvloop.server import app

        return getattr(app, name)
    if name == "ServerMetrics":
        from kvloop.server.metrics import ServerMetrics

        return ServerMetrics
    raise AttributeError(name)
