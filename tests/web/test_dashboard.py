"""``/dashboard`` in a live server: the key, the events, prompts only when asked, and the
page in a real browser while requests flow."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
livekit = pytest.importorskip("web.livekit")

from server.serverkit import build_tiny_model  # noqa: E402

KEY = "s3cret"
PROMPT = "<script>alert(1)</script> the quick brown fox jumps over the lazy dog " * 3


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def live(model: Path) -> Iterator[Any]:
    server = livekit.start(model, api_key=KEY)
    yield server
    server.stop()


def _load(url: str, n: int = 6, max_tokens: int = 48) -> None:
    """``n`` concurrent completions (more than the pool holds at once)."""
    def one() -> None:
        httpx.post(f"{url}/v1/completions", timeout=120,
                   headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "tiny-llama", "prompt": PROMPT, "max_tokens": max_tokens,
                         "ignore_eos": True})

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _first_event(url: str, **kw: Any) -> dict[str, Any]:
    with httpx.stream("GET", url, timeout=30, **kw) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                return json.loads(line[6:])
    raise AssertionError("no event")


def _wait(page: Any, expression: str, timeout_s: float) -> None:
    """Poll ``expression`` on the page until true (``wait_for_function`` would need the
    page's CSP to allow eval)."""
    for _ in range(int(timeout_s * 10)):
        if page.evaluate(expression):
            return
        page.wait_for_timeout(100)
    raise AssertionError(f"still false after {timeout_s} s: {expression}")


def test_the_key_guards_the_page_and_its_events(live: Any) -> None:
    for path in ("/dashboard", "/dashboard/events"):
        r = httpx.get(live.url + path, timeout=10)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    r = httpx.get(f"{live.url}/dashboard?key={KEY}", timeout=10)
    assert r.status_code == 200 and 'content="live"' in r.text
    assert httpx.get(f"{live.url}/dashboard/app.js", timeout=10).status_code == 200
    assert httpx.get(f"{live.url}/dashboard/nope.js", timeout=10).status_code == 404


def test_events_carry_step_records_but_no_prompts(live: Any) -> None:
    _load(live.url, n=2, max_tokens=4)
    event = _first_event(f"{live.url}/dashboard/events",
                         headers={"Authorization": f"Bearer {KEY}"})
    assert event["records"] and "scheduled" in event["records"][0]
    assert event["words"]["reasons"]["blocks"] == "no free KV blocks"
    assert "prompts" not in event


def test_prompts_only_when_asked(model: Path) -> None:
    server = livekit.start(model, show_prompts=True)
    try:
        httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 2})
        event = _first_event(f"{server.url}/dashboard/events")
        assert PROMPT in event["prompts"].values()
    finally:
        server.stop()


def test_the_live_page_while_requests_flow(live: Any, page: Any, shots: Path) -> None:
    page.goto(f"{live.url}/dashboard?key={KEY}")
    load = threading.Thread(target=_load, args=(live.url,))
    load.start()
    _wait(page, "kvloop.records.some(r => r.held.length > 0)", 60)
    load.join()
    _wait(page, "kvloop.records.some(r => r.finished.length > 0)", 30)
    assert "connected" in page.inner_text("#status")
    assert int(page.locator("#lanes").get_attribute("data-rows")) > 0
    page.click("#first")
    page.click("#next-refusal")
    text = page.inner_text("#decisions")
    assert "Left waiting" in text and "no free KV blocks" in text
    page.screenshot(path=str(shots / "dashboard.png"), full_page=True)
