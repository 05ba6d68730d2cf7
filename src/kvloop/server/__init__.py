"""The OpenAI-compatible server: ``kvloop serve`` (see ``command.py``).

Importing this package is cheap; FastAPI and uvicorn load with the modules that need them.
"""

from __future__ import annotations

__all__ = ["AsyncEngine", "ServerConfig", "ServerMetrics", "create_app"]


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
