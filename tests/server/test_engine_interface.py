"""The server sees the engine through commands in and a stats snapshot out: the event loop
never reads the scheduler, a request is validated once on the event loop (400 with the bad
field as ``param``), and a rejected request leaves the engine untouched."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from serverkit import MODEL_NAME, LiveServer

from kvloop.engine.intake import ValidatedRequest
from kvloop.engine.stats import EngineStats

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def guarded(new_server: Callable[..., LiveServer]) -> Iterator[tuple[LiveServer, list[str]]]:
    """A server whose engine records every read of ``scheduler`` off the engine thread."""
    live = new_server()
    engine = live.engine
    original = type(engine)
    offenders: list[str] = []

    class Guarded(original):  # type: ignore[misc, valid-type]
        @property
        def scheduler(self) -> Any:
            name = threading.current_thread().name
            if name != "kvloop-engine":
                offenders.append(name)
            return self.__dict__["scheduler"]

    engine.__class__ = Guarded
    try:
        yield live, offenders
    finally:
        engine.__class__ = original


def test_event_loop_never_reads_the_scheduler(guarded: tuple[LiveServer, list[str]]) -> None:
    live, offenders = guarded
    url = live.base_url
    body = {"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 4, "ignore_eos": True}
    assert httpx.post(f"{url}/completions", json=body, timeout=30).status_code == 200
    with httpx.stream("POST", f"{url}/completions", json={**body, "stream": True},
                      timeout=30) as r:
        assert r.status_code == 200 and sum(1 for _ in r.iter_lines()) > 1
    chat = {"model": MODEL_NAME, "messages": HI, "max_tokens": 3}
    assert httpx.post(f"{url}/chat/completions", json=chat, timeout=30).status_code == 200
    assert httpx.post(f"{url}/completions", json={**body, "max_tokens": 999},
                      timeout=30).status_code == 400
    live.async_engine.max_queued_requests = 1
    try:
        assert httpx.post(f"{url}/completions", json=body, timeout=30).status_code == 200
    finally:
        live.async_engine.max_queued_requests = None
    live.wait_idle()
    assert httpx.get(f"{url}/models", timeout=10).json()["data"][0]["max_model_len"] == 256
    assert offenders == []


def test_stats_snapshot_feeds_metrics(server: LiveServer) -> None:
    body = {"model": MODEL_NAME, "prompt": "the quick brown fox " * 12, "max_tokens": 5,
            "ignore_eos": True}
    for _ in range(2):  # the second one hits the prefix cache
        assert httpx.post(f"{server.base_url}/completions", json=body, timeout=30).is_success
    m = server.wait_idle()
    stats = server.async_engine.stats
    assert isinstance(stats, EngineStats)
    assert stats.num_unfinished == stats.num_running == stats.num_waiting == 0
    assert stats.kv_usage == 0.0
    assert m["kvloop:prefix_cache_queries_total"] == stats.scheduler.prefix_cache_queries
    assert m["kvloop:prefix_cache_hits_total"] == stats.scheduler.prefix_cache_hits > 0


BAD = [
    ("/completions", {"prompt": "hi", "cache_salt": ""}, "cache_salt", "cache_salt"),
    ("/completions", {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids",
     "stop_token_ids"),
    ("/completions", {"prompt": "hi", "min_p": 2.0}, "min_p", "min_p"),
    ("/completions", {"prompt": [1] * 130}, "prompt", "takes at most 127"),
    ("/completions", {"prompt": [1] * 100, "max_tokens": 50}, "max_tokens", "KV"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hello " * 200}]},
     "messages", "takes at most"),
    ("/chat/completions", {"messages": HI, "max_completion_tokens": 500},
     "max_completion_tokens", "max_model_len"),
    ("/chat/completions", {"messages": HI, "repetition_penalty": 0.0}, "repetition_penalty",
     "repetition_penalty"),
]


@pytest.mark.parametrize(("path", "body", "param", "message"), BAD,
                         ids=[p for _, _, p, _ in BAD])
def test_rejections_name_the_field_and_leave_the_engine_untouched(
        new_server: Callable[..., LiveServer], path: str, body: dict[str, Any], param: str,
        message: str) -> None:
    live = new_server(num_gpu_blocks=8)  # a KV pool of 128 tokens, under max_model_len 256
    r = httpx.post(f"{live.base_url}{path}", json={"model": MODEL_NAME, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err == {"message": err["message"], "type": "invalid_request_error",
                   "param": param, "code": 400}
    assert message in err["message"]
    live.wait_idle()
    stats = live.async_engine.stats
    assert stats.num_unfinished == 0 and stats.scheduler.num_steps == 0
    assert live.async_engine.num_active == 0


def test_async_engine_takes_only_validated_requests(server: LiveServer) -> None:
    vreq = server.engine.validate([5, 6, 7])
    assert isinstance(vreq, ValidatedRequest)
    with pytest.raises(TypeError):
        server.async_engine.add_request("x", [5, 6, 7], object())  # type: ignore[call-arg]
