"""Disconnect storm: many concurrent clients on a KV pool far too small for them (so requests
are preempted all the time, by recompute or by swap) go away at random points — before the
response starts, after a random number of streamed chunks, or while waiting for a
non-streamed reply — while the others read to the end.

Afterwards: every request is accounted for (finished by length or aborted, none failed), no
KV block is left owned on the device or the host tier, no request or stream is stuck, the
clients that stayed got exactly what the prompt alone gives (greedy), and the server goes on.
(The single-disconnect cases are in tests/server/test_streaming.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from dataclasses import dataclass, field

import httpx
import pytest
from reliakit import assert_no_leaks
from serverkit import MODEL_NAME, LiveServer

NUM_CLIENTS = 48
SEED = 1234


@dataclass
class Plan:
    """What one client does: its request and when it leaves."""

    prompt: str
    max_tokens: int
    stream: bool
    leave_after: int | None
    """Streamed: data chunks read before closing (0: right after the headers). Not streamed:
    milliseconds before giving up. ``None``: stays to the end."""
    early_cancel_ms: int | None = None
    """Cancel the request this soon, whatever state it is in (before or after headers)."""
    text: list[str] = field(default_factory=list)
    finished: str | None = None
    answered: bool = False
    """Got a response status (so its request surely reached the engine)."""


def _plans(rng: random.Random) -> list[Plan]:
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world",
             "cache", "block", "stream"]
    plans = []
    for i in range(NUM_CLIENTS):
        prompt = f"client {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(4, 24)))
        max_tokens = rng.randint(20, 80)
        kind = rng.random()
        if kind < 0.5:  # streamed, leaves after a random number of chunks
            plans.append(Plan(prompt, max_tokens, True, rng.randint(0, max_tokens - 1)))
        elif kind < 0.6:  # cancelled at a random instant (often before the first byte)
            plans.append(Plan(prompt, max_tokens, rng.random() < 0.5, None,
                              early_cancel_ms=rng.randint(0, 60)))
        elif kind < 0.7:  # not streamed, gives up waiting
            plans.append(Plan(prompt, max_tokens, False, rng.randint(5, 200)))
        else:  # stays to the end
            plans.append(Plan(prompt, max_tokens, rng.random() < 0.7, None))
    return plans


def _body(plan: Plan) -> dict:
    return {"model": MODEL_NAME, "prompt": plan.prompt, "max_tokens": plan.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": plan.stream}


async def _client(http: httpx.AsyncClient, plan: Plan) -> None:
    if plan.stream:
        async with http.stream("POST", "/completions", json=_body(plan)) as r:
            assert r.status_code == 200, await r.aread()
            plan.answered = True
            if plan.leave_after == 0:
                return
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    return
                event = json.loads(data)
                assert "error" not in event, event
                choice = event["choices"][0]
                plan.text.append(choice["text"])
                plan.finished = choice["finish_reason"] or plan.finished
                chunks += 1
                if plan.leave_after is not None and chunks >= plan.leave_after:
                    return  # leaving the block closes the connection mid-stream
    elif plan.leave_after is not None:
        with contextlib.suppress(httpx.TimeoutException):
            await http.post("/completions", json=_body(plan), timeout=plan.leave_after / 1000)
    else:
        r = await http.post("/completions", json=_body(plan))
        assert r.status_code == 200, r.text
        plan.answered = True
        choice = r.json()["choices"][0]
        plan.text.append(choice["text"])
        plan.finished = choice["finish_reason"]


async def _storm(live: LiveServer, plans: list[Plan]) -> None:
    limits = httpx.Limits(max_connections=NUM_CLIENTS)
    async with httpx.AsyncClient(base_url=live.base_url, timeout=120, limits=limits) as http:

        async def one(plan: Plan) -> None:
            task = asyncio.ensure_future(_client(http, plan))
            if plan.early_cancel_ms is None:
                await task
                return
            done, _ = await asyncio.wait({task}, timeout=plan.early_cancel_ms / 1000)
            if task in done:
                task.result()
            else:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

        await asyncio.gather(*(one(p) for p in plans))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_disconnect_storm_leaves_nothing_behind(new_server, mode: str) -> None:
    # 20 blocks of 16 tokens for 48 clients of up to ~110 tokens each: constant preemption.
    live = new_server(num_gpu_blocks=20, preemption_mode=mode, cost_aware_preemption=False,
                      swap_space=0.002 if mode == "swap" else 0.0, max_num_seqs=32,
                      max_num_batched_tokens=256)
    rng = random.Random(f"{SEED}-{mode}")
    plans = _plans(rng)
    asyncio.run(_storm(live, plans))

    m = assert_no_leaks(live)
    finished = {k: v for k, v in m.items() if k.startswith("kvloop:request_success_total{")}
    # Each request the engine got finished by length or was aborted. A client that gave up
    # within milliseconds may have gone before its request reached the engine (or even
    # before it connected), but every client that got a response status was counted.
    answered = sum(p.answered for p in plans)
    assert answered <= sum(finished.values()) <= NUM_CLIENTS, (answered, finished)
    assert answered >= NUM_CLIENTS // 2
    assert set(finished) <= {"kvloop:request_success_total{length}",
                             "kvloop:request_success_total{abort}"}, finished
    assert m["kvloop:num_requests_failed_total"] == 0
    stayed = [p for p in plans if p.leave_after is None and p.early_cancel_ms is None]
    assert m.get("kvloop:request_success_total{abort}", 0) <= NUM_CLIENTS - len(stayed)
    assert m.get("kvloop:request_success_total{abort}", 0) >= 10, "too few disconnects"
    counters = live.async_engine.stats.scheduler
    preempted = getattr(counters, f"num_{mode}_preemptions")
    assert preempted > 0, f"no {mode} preemption: the pool should have been too small"

    # Whoever stayed got exactly what its prompt gives alone (greedy, batch of one).
    assert all(p.finished == "length" for p in stayed), [p.finished for p in stayed]
    for p in stayed:
        solo = httpx.post(f"{live.base_url}/completions", json={**_body(p), "stream": False},
                          timeout=60)
        assert solo.status_code == 200, solo.text
        assert "".join(p.text) == solo.json()["choices"][0]["text"], p.prompt
    assert_no_leaks(live)
