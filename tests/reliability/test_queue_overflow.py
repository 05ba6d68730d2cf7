"""Queue overflow: a burst far beyond ``--max-queued-requests`` at a server whose steps are
slow. The overflow is refused at once with 429 in OpenAI's error shape (with ``Retry-After``
when the document declares it), everything admitted completes in full, nothing is left
behind, and once the burst is over the server takes a full queue's worth again.
(The exact-limit case is in tests/server/test_errors.py.)"""

from __future__ import annotations

import asyncio
import time

import httpx
from reliakit import assert_no_leaks, sse_events
from serverkit import MODEL_NAME, LiveServer, patched_execute, slow_steps

BURST = 60
MAX_QUEUED = 4
MAX_TOKENS = 6


def _body(i: int, stream: bool) -> dict:
    return {"model": MODEL_NAME, "prompt": f"burst {i}: hello world", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "temperature": 0.0, "stream": stream}


async def _one(http: httpx.AsyncClient, i: int) -> tuple[int, dict, float, list]:
    """(status, error body or {}, seconds to the status, SSE events)."""
    stream = i % 3 == 0
    t0 = time.monotonic()
    async with http.stream("POST", "/completions", json=_body(i, stream)) as r:
        elapsed = time.monotonic() - t0
        raw = await r.aread()
        headers = r.headers
    if r.status_code != 200:
        return r.status_code, {"json": r.json(), "headers": headers}, elapsed, []
    if stream:
        return 200, {}, elapsed, sse_events(raw.decode().splitlines())
    return 200, {}, elapsed, [r.json()]


async def _burst(live: LiveServer, n: int) -> list[tuple[int, dict, float, list]]:
    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(base_url=live.base_url, timeout=120, limits=limits) as http:
        return await asyncio.gather(*(_one(http, i) for i in range(n)))


def _retry_after_declared(live: LiveServer) -> bool:
    doc = httpx.get(f"{live.url}/openapi.json", timeout=10).json()
    refused = doc["paths"]["/v1/completions"]["post"].get("responses", {}).get("429", {})
    return "Retry-After" in refused.get("headers", {})


def test_burst_gets_429s_and_the_server_recovers(new_server) -> None:
    live = new_server(max_queued_requests=MAX_QUEUED, max_num_seqs=4)
    with patched_execute(live.engine, slow_steps(0.03)):
        results = asyncio.run(_burst(live, BURST))

    refused = [r for r in results if r[0] == 429]
    served = [r for r in results if r[0] == 200]
    assert len(refused) + len(served) == BURST, sorted({r[0] for r in results})
    assert len(refused) >= BURST // 2, f"only {len(refused)} of {BURST} refused"
    assert len(served) >= MAX_QUEUED
    must_retry_after = _retry_after_declared(live)
    for _, err, elapsed, _ in refused:
        body = err["json"]["error"]
        assert body["code"] == 429 and body["type"] and isinstance(body["message"], str), body
        assert elapsed < 5, "a refusal should not wait for the queue"
        retry_after = err["headers"].get("retry-after")
        if must_retry_after or retry_after is not None:
            assert retry_after is not None and retry_after.isdigit(), err["headers"]
    for _, _, _, events in served:  # every admitted request completed in full
        if events and events[-1] == "[DONE]":
            chunks = [e for e in events if isinstance(e, dict)]
            assert all("error" not in c for c in chunks), chunks
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        else:
            (reply,) = events
            assert reply["usage"]["completion_tokens"] == MAX_TOKENS, reply
    m = assert_no_leaks(live)
    assert m["kvloop:request_success_total{length}"] == len(served)
    assert m["kvloop:num_requests_failed_total"] == 0

    # Recovered: a full queue's worth (plus what runs) is taken again, all of it served.
    again = asyncio.run(_burst(live, MAX_QUEUED))
    assert [r[0] for r in again] == [200] * MAX_QUEUED
    assert_no_leaks(live)
