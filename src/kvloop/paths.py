"""Where kvloop keeps what it derives once and reuses (stdlib only: every layer may use it)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$KVLOOP_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvloop``, else ``~/.cache/kvloop``: the
    converted models, the tokenizer records and the compiled CPU kernels."""
    if env := os.environ.get("KVLOOP_CACHE_DIR"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvloop"
