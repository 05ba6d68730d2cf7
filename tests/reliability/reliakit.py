"""Helpers of the reliability suite: the leak check, SSE reading, request bodies.

A plain module (not conftest) so that tests can import its helpers by name."""

from __future__ import annotations

import time

from serverkit import LiveServer


def assert_no_leaks(live: LiveServer, timeout: float = 20.0) -> dict[str, float]:
    """Wait until the server is idle, then assert that nothing is left behind: no request
    running, waiting or swapped (``/metrics`` and the engine's snapshot), no KV block owned
    on the device or the host tier, no stream a handler still waits on, and the scheduler's
    invariants hold. Returns the last ``/metrics`` samples."""
    deadline = time.monotonic() + timeout
    while True:
        m = live.wait_idle(timeout=max(0.1, deadline - time.monotonic()))
        stats = live.async_engine.stats
        idle = (stats.num_unfinished == 0 and stats.num_swapped == 0 and stats.kv_usage == 0
                and live.async_engine.num_active == 0
                and m["kvloop:num_requests_swapped"] == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert m["kvloop:num_requests_running"] == 0, m
    assert m["kvloop:num_requests_waiting"] == 0, m
    assert m["kvloop:num_requests_swapped"] == 0, m
    assert m["kvloop:kv_cache_usage_perc"] == 0, m
    assert stats.num_unfinished == 0 and stats.num_swapped == 0, stats
    assert stats.kv_usage == 0, stats
    assert live.async_engine.num_active == 0, "a stream was never finished"
    # The engine thread sleeps when it has no work; holding its condition keeps it from
    # starting a step while the scheduler is read from this thread.
    engine = live.engine
    with live.async_engine._cond:
        assert not engine.has_unfinished_requests()
        kv = engine.scheduler.kv
        assert kv.num_used_blocks == 0, f"{kv.num_used_blocks} device blocks leaked"
        assert not kv.swapped_blocks, f"host blocks leaked: {kv.swapped_blocks}"
        assert kv.num_free_cpu_blocks == kv.num_cpu_blocks, "host blocks leaked"
        engine.scheduler.check_invariants()
    return m


def sse_events(lines: list[str]) -> list[dict | str]:
    """The ``data:`` payloads of an SSE stream: parsed JSON, or the string ``[DONE]``."""
    import json

    out: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
