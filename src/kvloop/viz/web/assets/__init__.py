"""The page's files (``index.html``, ``app.js``, ``app.css``), read from the package."""

from __future__ import annotations

from functools import cache
from importlib import resources

ASSET_NAMES: dict[str, str] = {
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
}
"""The files the page loads, by name, with their content types."""

MODES = ("trace", "live")
"""``trace``: the page fetches ``trace.json`` once; ``live``: it listens to
``dashboard/events`` (server-sent events)."""


@cache
def _read(name: str) -> bytes:
    return resources.files(__name__).joinpath(name).read_bytes()


def asset(name: str) -> tuple[bytes, str] | None:
    """The bytes and content type of one of ``ASSET_NAMES`` (None for any other name)."""
    kind = ASSET_NAMES.get(name)
    return None if kind is None else (_read(name), kind)


def page(mode: str, base: str = "") -> bytes:
    """The page in ``mode`` (one of ``MODES``), loading its files from ``base`` (a path
    prefix ending in ``/``, or empty for the page's own folder)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    html = _read("index.html").decode()
    return html.replace("{{MODE}}", mode).replace("{{BASE}}", base).encode()
