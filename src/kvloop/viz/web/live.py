"""The web view's parts for a live server's ``/dashboard`` (``kvloop.server.dashboard``)."""

from __future__ import annotations

from typing import Any

from kvloop.viz.web.assets import ASSET_NAMES, asset, page
from kvloop.viz.web.payload import words


def dashboard_parts() -> dict[str, Any]:
    """``install_dashboard``'s ``page``, ``files`` and ``words``."""
    files = {name: found for name in ASSET_NAMES if (found := asset(name)) is not None}
    return {"page": page("live", "/dashboard/"), "files": files, "words": words()}
