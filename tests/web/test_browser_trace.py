"""The trace view in a real browser: step through a recorded trace and read the page."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvloop.cli import main
from kvloop.viz.summary import load_records
from kvloop.viz.web.trace_view import TraceViewServer
from web.traces import tight_pool_trace


@pytest.fixture
def view() -> Iterator[TraceViewServer]:
    server = TraceViewServer(tight_pool_trace(), "tight.jsonl", "127.0.0.1", 0)
    server.start()
    yield server
    server.shutdown()
    server.server_close()


def _open(page: Any, url: str) -> None:
    page.goto(url)
    page.wait_for_selector('body[data-ready="1"]', timeout=15_000)


def test_step_through_a_trace(page: Any, view: TraceViewServer, shots: Path) -> None:
    records = tight_pool_trace()
    _open(page, view.url)
    assert page.inner_text("#step-number") == "0"
    # step 0: three prompts admitted, the fourth (an id with markup) refused for blocks
    summary = page.locator("#batch-summary")
    assert summary.get_attribute("data-prefills") == "3"
    assert summary.get_attribute("data-tokens") == str(records[0].num_batched_tokens)
    decisions = page.inner_text("#decisions")
    assert "Left waiting <b>x</b>: no free KV blocks." in decisions
    assert page.locator("#decisions b").count() == 0  # shown as text, not markup
    # the next preemption: step 1, C by recompute for A's block
    page.click("#next-preemption")
    assert page.inner_text("#step-number") == "1"
    assert "Preempted C by recompute: KV blocks needed by A." in page.inner_text("#decisions")
    kv = page.locator("#kv-summary")
    assert kv.get_attribute("data-used") == str(records[1].kv_blocks_used)
    assert kv.get_attribute("data-total") == "6"
    assert page.locator("#batch-table tbody tr").count() == len(records[1].scheduled)
    # the next refusal: C waits for blocks
    page.click("#next-refusal")
    assert page.inner_text("#step-number") == "2"
    assert "Left waiting C: no free KV blocks." in page.inner_text("#decisions")
    # the slider, the arrow keys and the buttons agree
    page.click("#forward")
    page.keyboard.press("ArrowRight")
    assert page.inner_text("#step-number") == "4"
    page.click("#back")
    assert page.evaluate("kvloop.selected") == 3
    page.locator("#slider").fill(str(len(records) - 1))
    assert page.inner_text("#step-number") == str(records[-1].step)
    page.screenshot(path=str(shots / "trace-view-small.png"), full_page=True)


def test_a_simulated_trace(page: Any, tmp_path: Path, shots: Path) -> None:
    trace = tmp_path / "sim.jsonl"
    assert main(["simulate", "--num-requests", "60", "--request-rate", "20",
                 "--prompt-len", "512", "--output-len", "128", "--num-gpu-blocks", "200",
                 "--max-num-seqs", "32", "--no-cost-aware-preemption",
                 "--no-progress", "--trace-out", str(trace)]) == 0
    records = load_records(str(trace))
    first = next(i for i, r in enumerate(records) if r.preempted)
    server = TraceViewServer(records, "sim.jsonl", "127.0.0.1", 0)
    server.start()
    try:
        _open(page, server.url)
        page.click("#next-preemption")
        assert page.evaluate("kvloop.selected") == first
        victim = records[first].preempted[0][0]
        assert f"Preempted {victim} by recompute" in page.inner_text("#decisions")
        assert int(page.locator("#lanes").get_attribute("data-rows")) > 10
        page.screenshot(path=str(shots / "trace-view.png"), full_page=True)
    finally:
        server.shutdown()
        server.server_close()
