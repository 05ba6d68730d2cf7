"""The dashboard's ring of recent steps and its book of prompts (no server)."""

from __future__ import annotations

import io

import pytest

pytest.importorskip("fastapi")

from kvloop.server.dashboard import LiveRecorder, PromptBook
from web.traces import tight_pool_trace


def test_the_ring_keeps_the_last_steps_and_still_writes_every_one() -> None:
    records = tight_pool_trace()
    sink = io.StringIO()
    ring = LiveRecorder(sink=sink, size=5)
    for r in records:
        ring.add(r)
    assert sink.getvalue().count("\n") == len(records)
    got, count = ring.since(0, 100)
    assert count == len(records) and got == records[-5:]
    got, _ = ring.since(count - 2, 100)
    assert got == records[-2:]
    got, _ = ring.since(0, 3)
    assert got == records[-3:]
    assert ring.since(count, 100) == ([], count)


def test_the_prompt_book_forgets_the_oldest() -> None:
    book = PromptBook(size=2)
    for i in range(3):
        book.note(f"r{i}", f"prompt {i}")
    book.note("r3", None)  # a request without prompt text
    assert book.latest(5) == {"r1": "prompt 1", "r2": "prompt 2"}
    assert book.latest(1) == {"r2": "prompt 2"} and book.count == 3
