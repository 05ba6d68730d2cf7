"""Bad input gets its status and an OpenAI error body; a full queue gets 429; a failing model
step fails only its requests with a 500 and the server goes on."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest
from serverkit import MODEL_NAME, LiveServer, patched_execute

openai = pytest.importorskip("openai")

C, CHAT = "/completions", "/chat/completions"
HI = [{"role": "user", "content": "hi"}]

BAD = [
    (C, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    (C, {"prompt": "hi", "temperature": -0.5}, 400, "temperature", "temperature"),
    (C, {"prompt": "hi", "top_p": 0.0}, 400, "top_p", "top_p"),
    (C, {"prompt": "hi", "top_p": 1.5}, 400, "top_p", "top_p"),
    (C, {"prompt": "hi", "top_k": -3}, 400, "top_k", "top_k"),
    (C, {"prompt": "hi", "presence_penalty": 3.0}, 400, "presence_penalty", "presence_penalty"),
    (C, {"prompt": list(range(3, 303))}, 400, "prompt", "the model takes at most"),
    (C, {"prompt": "hi " * 400}, 400, "prompt", "the model takes at most"),
    (C, {"prompt": list(range(3, 203)), "max_tokens": 100}, 400, "max_tokens",
     "max_model_len"),
    (C, {"prompt": [10**6]}, 400, "prompt", "prompt_token_ids must be in"),
    (C, {"prompt": ""}, 400, "prompt", "must not be empty"),
    (C, {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
    (C, {"prompt": "hi", "temperature": "hot"}, 400, "temperature", "valid number"),
    (C, {"prompt": "hi", "stream": "yes"}, 400, "stream", "valid boolean"),
    (C, {"prompt": 5}, 400, "prompt",
     "prompt: expected one of str, list[int], list[str], list[list[int]] (got 5)"),
    (C, {"prompt": [1.5]}, 400, "prompt", "expected one of str, list[int]"),
    (C, {"prompt": "hi", "stop": 5}, 400, "stop", "stop: expected one of str, list[str]"),
    (C, {"prompt": "hi", "n": 0}, 400, "n", "at least 1"),
    (C, {"prompt": "hi", "n": 65}, 400, "n", "exceeds max_num_seqs"),
    (C, {"prompt": "hi", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens", "[0, max_tok"),
    (C, {"prompt": ["a", "b"]}, 400, "prompt", "not supported yet"),
    (C, {"prompt": "hi", "logprobs": 50}, 400, "logprobs", "logprobs must be in"),
    (C, {"prompt": "hi", "echo": True}, 400, "echo", "echo is not supported"),
    (C, {"prompt": "hi", "bogus": 1}, 400, "bogus", "unknown field 'bogus'"),
    (C, {"max_tokens": 3}, 400, "prompt", "'prompt' is required"),
    (C, {"prompt": "hi", "model": "gpt-4"}, 404, "model", "does not exist"),
    (C, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "stream: true"),
    (C, {"prompt": "hi", "priority": "high"}, 400, "priority", "valid integer"),
    (CHAT, {"messages": []}, 400, "messages", "must not be empty"),
    (CHAT, {"messages": HI, "max_completion_tokens": 0}, 400, "max_completion_tokens",
     "at least 1"),
    (CHAT, {"messages": HI, "top_logprobs": 2}, 400, "top_logprobs", "logprobs: true"),
    (CHAT, {"messages": HI, "n": -3}, 400, "n", "at least 1"),
    (CHAT, {"messages": HI, "max_tokens": 0, "max_completion_tokens": 1}, 400, "max_tokens",
     "at least 1"),
    (CHAT, {"messages": [{"content": "x"}]}, 400, "messages", "required"),
    (CHAT, {"messages": [{"role": "bogus", "content": "x"}]}, 400, "messages",
     "messages.0.role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool' "
     "(got 'bogus')"),
    (CHAT, {"messages": HI, "tools": [{"type": "function"}]}, 400, "tools", "not supported"),
    (CHAT, {"messages": HI, "model": "nope"}, 404, "model", "does not exist"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "message"), BAD,
                         ids=[f"{p}-{i}" for i, (p, *_) in enumerate(BAD)])
def test_bad_input(server: LiveServer, path: str, body: dict[str, Any], status: int,
                   param: str, message: str) -> None:
    r = httpx.post(f"{server.base_url}{path}", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["param"] == param
    assert message in err["message"], err["message"]


@pytest.mark.parametrize("raw", [b'{"prompt": ', b"not json", b"[1, 2]", b""])
def test_malformed_json(server: LiveServer, raw: bytes) -> None:
    r = httpx.post(f"{server.base_url}/completions", content=raw,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [rb'{"prompt": "\ud800 hi"}', rb'{"prompt": "\udc00"}'])
def test_lone_surrogate_is_named(server: LiveServer, raw: bytes) -> None:
    """JSON allows an escaped lone UTF-16 surrogate, Unicode text does not: the 400 says so
    rather than only the parser's "hex escape" words."""
    r = httpx.post(f"{server.base_url}/completions", content=raw,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400
    assert "lone surrogate is not Unicode text" in r.json()["error"]["message"], r.text


def test_unknown_route_is_an_openai_404(server: LiveServer) -> None:
    r = httpx.get(f"{server.base_url}/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


def test_openai_client_sees_bad_request(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="exceeds max_num_seqs"):
        client.completions.create(model=MODEL_NAME, prompt="hi", n=1000)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=HI)


def test_api_key(new_server) -> None:
    live = new_server(api_key="sekret")
    url = f"{live.base_url}/completions"
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    assert httpx.post(url, json=body).status_code == 401
    wrong = httpx.post(url, json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == 401
    assert wrong.text.startswith('{"error":{"message":')  # compact, as every other error
    assert httpx.get(f"{live.base_url}/models").status_code == 401
    assert httpx.get(f"{live.url}/health").status_code == 200  # probes need no key
    ok = openai.OpenAI(base_url=live.base_url, api_key="sekret", max_retries=0)
    assert ok.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2).usage
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live.base_url, api_key="bad", max_retries=0).models.list()


def _blocking(gate: threading.Event, entered: threading.Event):
    def wrap(execute):
        def blocked(out):
            entered.set()
            gate.wait(60)
            return execute(out)

        return blocked

    return wrap


def test_queue_full_gets_429(server: LiveServer) -> None:
    gate, entered = threading.Event(), threading.Event()
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, "ignore_eos": True}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            first = asyncio.create_task(http.post("/completions", json=body))
            while not entered.is_set():  # the engine is stuck in the first request's step
                await asyncio.sleep(0.01)
            queued = [asyncio.create_task(http.post("/completions", json=body))
                      for _ in range(2)]
            # NOTE: polled, not slept on: each must pass HTTP parsing and the tokenizer
            # workers first, which a loaded machine can delay past any fixed sleep.
            deadline = time.monotonic() + 20
            while server.async_engine._pending_adds < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert server.async_engine._pending_adds == 2, "queued requests never arrived"
            refused = await http.post("/completions", json=body)
            gate.set()
            return [refused, await first, *await asyncio.gather(*queued)]

    server.async_engine.max_queued_requests = 2
    try:
        with patched_execute(server.engine, _blocking(gate, entered)):
            refused, *served = asyncio.run(run())
    finally:
        server.async_engine.max_queued_requests = None
        gate.set()
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == 429
    assert "queue is full" in refused.json()["error"]["message"]
    assert [r.status_code for r in served] == [200, 200, 200]


def _failing(execute):
    def fail(out):
        raise RuntimeError("injected fault")

    return fail


def test_model_step_failure_is_a_500_and_the_server_goes_on(server: LiveServer) -> None:
    url = f"{server.base_url}/completions"
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4}
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    with patched_execute(server.engine, _failing):
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["code"] == 500 and "model step failed" in err["message"]
        assert "injected fault" in err["message"]
        with pytest.raises(openai.APIError, match="model step failed"):
            for _ in client.completions.create(stream=True, **body):
                pass
    assert server.wait_idle()["kvloop:num_requests_failed_total"] >= 2
    ok = client.completions.create(**body)
    assert ok.usage.completion_tokens >= 1


def test_cli_rejects_bad_server_flags(capsys) -> None:
    from kvloop.cli import main

    assert main(["serve", "--max-queued-requests", "0"]) == 2
    assert "--max-queued-requests must be >= 1" in capsys.readouterr().err


def test_engine_loop_error_fails_its_requests_and_the_loop_goes_on(server: LiveServer) -> None:
    engine = server.engine
    original = engine.step

    def broken_step():
        engine.step = original  # type: ignore[method-assign]  # fail once
        raise RuntimeError("scheduler bug")

    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4}
    engine.step = broken_step  # type: ignore[method-assign]
    try:
        r = httpx.post(f"{server.base_url}/completions", json=body, timeout=30)
    finally:
        engine.step = original  # type: ignore[method-assign]
    assert r.status_code == 500 and "engine loop error" in r.json()["error"]["message"]
    server.wait_idle()
    ok = httpx.post(f"{server.base_url}/completions", json=body, timeout=30)
    assert ok.status_code == 200
