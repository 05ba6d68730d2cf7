"""In the API: ``user``/``tenant`` name the tenant, ``slo_ttft``/``slo_tpot`` are a
request's SLO targets, and a request the scheduling policy rejects is a 429 (an SSE error
event when streamed) that leaves nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from serverkit import MODEL_NAME, LiveServer

from kvloop.core.request import Request, RequestStatus

REJECT_TENANT = "reject-me"


def _body(chat: bool, **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0}
    if chat:
        return {**base, "messages": [{"role": "user", "content": "hello world"}], **extra}
    return {**base, "prompt": "hello world", **extra}


def _path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def _events(text: str) -> list[Any]:
    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@contextlib.contextmanager
def _spy_arrivals(live: LiveServer) -> Iterator[list[Request]]:
    """Every ``Request`` the scheduler is given while the block runs."""
    sched = live.engine.scheduler
    original = sched.add_request
    seen: list[Request] = []

    def spy(request: Request) -> None:
        seen.append(request)
        original(request)

    sched.add_request = spy  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        sched.add_request = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _rejecting(live: LiveServer, tenant: str = REJECT_TENANT) -> Iterator[None]:
    """Make the scheduler reject every waiting request of ``tenant`` at its next
    ``schedule()``, as policy ``slo`` with ``slo_overload="reject"`` does for a request that
    can no longer meet its TTFT (on the engine thread: the only one that touches it)."""
    sched = live.engine.scheduler
    schedule = sched.schedule

    def rejecting_schedule() -> Any:
        for rid, req in list(sched.requests.items()):
            if req.tenant == tenant and req.status == RequestStatus.WAITING:
                req.error = "cannot meet its TTFT target (test)"
                sched.finish_request(rid, RequestStatus.FINISHED_REJECTED)
        return schedule()

    sched.schedule = rejecting_schedule  # type: ignore[method-assign]
    try:
        yield
    finally:
        sched.schedule = schedule  # type: ignore[method-assign]


def _assert_clean(live: LiveServer) -> None:
    m = live.wait_idle()
    assert m["kvloop:num_requests_running"] == 0
    assert m["kvloop:num_requests_waiting"] == 0
    assert m["kvloop:kv_cache_usage_perc"] == 0
    assert live.engine.scheduler.kv.num_used_blocks == 0
    assert not live.engine.has_unfinished_requests()
    assert live.async_engine.num_active == 0


# -- the fields reach the engine --------------------------------------------------------
@pytest.mark.parametrize("chat", [False, True])
def test_user_names_the_tenant_and_tenant_overrides_it(server: LiveServer, chat: bool) -> None:
    job = server.serving.chat_job if chat else server.serving.completion_job
    made = job(json.dumps(_body(chat, user="alice")).encode(), 0.0).request
    assert made.tenant == "alice"
    made = job(json.dumps(_body(chat, user="alice", tenant="acme")).encode(), 0.0).request
    assert made.tenant == "acme"
    made = job(json.dumps(_body(chat, slo_ttft=0.5, slo_tpot=2)).encode(), 0.0).request
    assert (made.tenant, made.slo_ttft, made.slo_tpot) == ("", 0.5, 2.0)


def test_fields_reach_the_scheduler(server: LiveServer) -> None:
    with _spy_arrivals(server) as seen:
        r = httpx.post(f"{server.url}/v1/completions", timeout=30, json=_body(
            False, user="bob", slo_ttft=1.5, slo_tpot=0.25))
        r2 = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json=_body(
            True, user="bob", tenant="team-a"))
    assert r.status_code == 200 and r2.status_code == 200, (r.text, r2.text)
    assert [(q.tenant, q.slo_ttft, q.slo_tpot) for q in seen] == [
        ("bob", 1.5, 0.25), ("team-a", None, None)]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(("extra", "param"), [
    ({"slo_ttft": 0}, "slo_ttft"),
    ({"slo_ttft": -1.0}, "slo_ttft"),
    ({"slo_tpot": 1e12}, "slo_tpot"),
    ({"slo_tpot": "fast"}, "slo_tpot"),
    ({"tenant": "x" * 257}, "tenant"),
    ({"user": "u" * 257}, "user"),
    ({"tenant": 7}, "tenant"),
])
def test_bad_scheduling_fields_are_400_naming_the_field(
        server: LiveServer, chat: bool, extra: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{server.url}{_path(chat)}", json=_body(chat, **extra), timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err


# -- a rejected request ---------------------------------------------------------------
def test_rejection_is_a_429_and_leaves_nothing_behind(server: LiveServer) -> None:
    before = server.metrics().get("kvloop:request_success_total{rejected}", 0.0)
    with _rejecting(server):
        for chat in (False, True):
            r = httpx.post(f"{server.url}{_path(chat)}", timeout=30,
                           json=_body(chat, tenant=REJECT_TENANT, n=2))
            assert r.status_code == 429, r.text
            err = r.json()["error"]
            assert err["code"] == 429 and err["type"] == "rate_limit_error"
            assert "TTFT" in err["message"]
            assert r.headers.get("retry-after")
            ok = httpx.post(f"{server.url}{_path(chat)}", json=_body(chat), timeout=30)
            assert ok.status_code == 200, ok.text
    _assert_clean(server)
    after = server.metrics()
    assert after["kvloop:request_success_total{rejected}"] - before == 2


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_rejection_is_an_sse_error_then_done(server: LiveServer, chat: bool) -> None:
    with _rejecting(server):
        r = httpx.post(f"{server.url}{_path(chat)}", timeout=30,
                       json=_body(chat, stream=True, user=REJECT_TENANT))
    assert r.status_code == 200
    events = _events(r.text)
    assert events[-1] == "[DONE]"
    errors = [e for e in events[:-1] if "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["code"] == 429, events
    assert "TTFT" in errors[0]["error"]["message"]
    assert not any(c.get("finish_reason") for e in events[:-1] if "choices" in e
                   for c in e["choices"])
    _assert_clean(server)


# -- the real policy (core's 'slo' with slo_overload 'reject') -------------------------------
async def _fire(url: str, bodies: list[tuple[str, dict[str, Any]]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60) as client:
        return list(await asyncio.gather(*(client.post(url + p, json=b) for p, b in bodies)))


def test_slo_policy_rejects_what_it_cannot_serve_in_time(
        new_server: Callable[..., LiveServer]) -> None:
    live = new_server(scheduling_policy="slo", slo_ttft=30.0, slo_overload="reject",
                      max_num_seqs=2, max_num_batched_tokens=64)
    # NOTE: a TTFT of a microsecond cannot be met once anything ran before it; the server's
    # own 30 s default is met by the requests without a target of their own.
    bodies = [(_path(i % 2 == 1), _body(i % 2 == 1, slo_ttft=1e-6, max_tokens=8))
              for i in range(8)]
    bodies += [("/v1/completions", _body(False, max_tokens=8)) for _ in range(2)]
    streamed = [("/v1/completions", _body(False, slo_ttft=1e-6, stream=True)) for _ in range(4)]
    responses = asyncio.run(_fire(live.url, bodies + streamed))
    plain, streams = responses[:len(bodies)], responses[len(bodies):]
    codes = [r.status_code for r in plain]
    assert set(codes) <= {200, 429}, [r.text for r in plain]
    assert codes[-2:] == [200, 200]
    stream_errors = [e["error"]["code"] for r in streams for e in _events(r.text)[:-1]
                     if "error" in e]
    assert set(stream_errors) <= {429}
    assert all(_events(r.text)[-1] == "[DONE]" for r in streams)
    rejected = codes.count(429) + len(stream_errors)
    assert rejected >= 1, "nothing was rejected"
    for r in plain:
        if r.status_code == 429:
            assert r.json()["error"]["code"] == 429
    _assert_clean(live)
    assert live.metrics()["kvloop:request_success_total{rejected}"] == rejected
