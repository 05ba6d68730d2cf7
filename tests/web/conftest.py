"""Fixtures of the web view's tests: Chromium driven by Playwright, and a live server."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
"""Flags of a headless Chromium that reaches nothing but the test's own servers."""


def find_chromium() -> str | None:
    """Debian's Chromium (``apt-get install chromium``), or ``$KVLOOP_CHROMIUM``."""
    for path in (os.environ.get("KVLOOP_CHROMIUM"), "/usr/bin/chromium",
                 shutil.which("chromium"), shutil.which("chromium-browser")):
        if path and os.path.exists(path):
            return path
    return None


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    path = find_chromium()
    if path is None:
        pytest.skip("no Chromium found (apt-get install -y chromium, or set KVLOOP_CHROMIUM)")
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="Playwright's Python package is not installed")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh page; any script error on it fails the test."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    context.close()
    assert not errors, errors


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    """Where screenshots go: ``$KVLOOP_SCREENSHOT_DIR`` (docs/img for the docs), else a
    temporary folder."""
    out = Path(os.environ.get("KVLOOP_SCREENSHOT_DIR") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    return out
