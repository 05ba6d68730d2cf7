"""HTTP details: 405 keeps ``Allow``, 429 carries ``Retry-After``, with an API key nothing
under /v1 answers without it (no probing), ``best_of`` < 1 and non-finite sampling numbers
are 400s naming the field, ``/health`` is JSON and turns 503 once the server drains."""

from __future__ import annotations

import math
import signal

import httpx
import pytest
from serverkit import MODEL_NAME, LiveServer, patched_execute, slow_steps

from kvloop.errors import InvalidRequestError
from kvloop.sampling_params import SamplingParams


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["param"] == param
    return err


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("GET", "/v1/completions", "POST"),
    ("PUT", "/v1/chat/completions", "POST"),
    ("POST", "/v1/models", "GET"),
    ("DELETE", "/health", "GET"),
])
def test_405_keeps_allow(server: LiveServer, method: str, path: str, allow: str) -> None:
    r = httpx.request(method, f"{server.url}{path}")
    assert_error(r, 405)
    assert allow in r.headers["allow"]


def test_429_carries_retry_after(server: LiveServer) -> None:
    server.async_engine.max_queued_requests = 0  # NOTE: every request finds the queue full
    try:
        r = httpx.post(f"{server.base_url}/completions", json={"prompt": "hi"}, timeout=30)
    finally:
        server.async_engine.max_queued_requests = None
    assert "queue is full" in assert_error(r, 429)["message"]
    assert int(r.headers["retry-after"]) >= 1


PROBES = [("GET", "/v1/nothing-here"), ("POST", "/v1/nothing-here"), ("GET", "/v1"),
          ("GET", "/v1/completions"), ("DELETE", "/v1/models"), ("POST", "/v1/models"),
          ("GET", "/v1/chat/completions"), ("POST", "/v1/completions")]


@pytest.fixture(scope="module")
def keyed(tiny_model):
    from serverkit import start_server

    live = start_server(tiny_model, api_key="sekret")
    yield live
    live.stop()


@pytest.mark.parametrize(("method", "path"), PROBES)
def test_api_key_guards_every_v1_path_and_method(keyed: LiveServer, method: str,
                                                 path: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        r = httpx.request(method, f"{keyed.url}{path}", headers=headers)
        assert_error(r, 401)
        assert r.headers["www-authenticate"] == "Bearer"


def test_with_the_key_routes_answer_as_usual(keyed: LiveServer) -> None:
    key = {"Authorization": "Bearer sekret"}
    assert_error(httpx.get(f"{keyed.url}/v1/nothing-here", headers=key), 404)
    wrong = httpx.get(f"{keyed.url}/v1/completions", headers=key)
    assert_error(wrong, 405)
    assert wrong.headers["allow"] == "POST"
    assert httpx.get(f"{keyed.base_url}/models", headers=key).status_code == 200
    for path in ("/health", "/version", "/metrics", "/openapi.json"):  # no key needed
        assert httpx.get(f"{keyed.url}{path}").status_code == 200, path


@pytest.mark.parametrize(("best_of", "status", "message"), [
    (0, 400, "best_of must be >= 1, got 0"),
    (-3, 400, "best_of must be >= 1, got -3"),
    (2, 400, "best_of must equal n"),
    (1, 200, None),
])
def test_best_of(server: LiveServer, best_of: int, status: int, message: str | None) -> None:
    r = httpx.post(f"{server.base_url}/completions", timeout=30,
                   json={"prompt": "hi", "max_tokens": 2, "best_of": best_of})
    if status == 200:
        assert r.status_code == 200, r.text
    else:
        assert message in assert_error(r, status, "best_of")["message"]


@pytest.mark.parametrize(("field", "literal"), [
    ("temperature", "Infinity"), ("temperature", "-Infinity"), ("temperature", "NaN"),
    ("temperature", "1e999"), ("top_p", "Infinity"), ("min_p", "NaN"),
    ("presence_penalty", "-Infinity"), ("frequency_penalty", "Infinity"),
    ("repetition_penalty", "Infinity"), ("repetition_penalty", "NaN"),
])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_non_finite_numbers_are_refused(server: LiveServer, field: str, literal: str,
                                        chat: bool) -> None:
    prompt = '"messages": [{"role": "user", "content": "hi"}]' if chat else '"prompt": "hi"'
    raw = f'{{{prompt}, "max_tokens": 2, "{field}": {literal}}}'
    path = "/chat/completions" if chat else "/completions"
    r = httpx.post(f"{server.base_url}{path}", content=raw, timeout=30,
                   headers={"Content-Type": "application/json"})
    assert "finite" in assert_error(r, 400, field)["message"]


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_sampling_params_refuse_non_finite(value: float) -> None:
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        with pytest.raises(InvalidRequestError, match="finite") as info:
            SamplingParams(**{name: value})
        assert info.value.field == name


def test_health_is_json(server: LiveServer) -> None:
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"status": "ok"}


def test_health_is_503_while_draining(new_server) -> None:
    live = new_server(shutdown_timeout=10)
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 40, "ignore_eos": True,
            "stream": True}
    with patched_execute(live.engine, slow_steps(0.02)), httpx.Client(timeout=30) as http, \
            http.stream("POST", f"{live.base_url}/completions", json=body) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        live.server.handle_exit(signal.SIGTERM, None)
        health = httpx.get(f"{live.url}/health")
        assert "draining" in assert_error(health, 503)["message"]
        rest = list(lines)  # the request in flight still finishes
    assert "data: [DONE]" in rest
    live.thread.join(10)
    assert not live.thread.is_alive()
