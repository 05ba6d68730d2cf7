"""Many concurrent streams each get exactly their own tokens; a client that goes away (streaming
or not) has its request aborted and its KV blocks returned."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from serverkit import MODEL_NAME, LiveServer, patched_execute, slow_steps

openai = pytest.importorskip("openai")

NUM_CLIENTS = 32
MAX_TOKENS = 10


def test_32_concurrent_streams_get_their_own_tokens(server: LiveServer) -> None:
    prompts = [f"client {i}: the quick brown fox number {i * 7919 % 1000}" for i in
               range(NUM_CLIENTS)]
    kw = {"model": MODEL_NAME, "max_tokens": MAX_TOKENS, "temperature": 0.0,
          "extra_body": {"ignore_eos": True}}

    async def run() -> tuple[list[str], list[tuple[str, int]]]:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)

        async def one(prompt: str) -> tuple[str, int]:
            stream = await client.completions.create(
                prompt=prompt, stream=True, stream_options={"include_usage": True}, **kw)
            text, usage = [], 0
            async for chunk in stream:
                if chunk.choices:
                    text.append(chunk.choices[0].text)
                else:
                    usage = chunk.usage.completion_tokens
            return "".join(text), usage

        streamed = await asyncio.gather(*(one(p) for p in prompts))
        # References one at a time (batch of one): what each prompt alone produces.
        refs = []
        for p in prompts:
            refs.append((await client.completions.create(prompt=p, **kw)).choices[0].text)
        await client.close()
        return refs, streamed

    refs, streamed = asyncio.run(run())
    assert [u for _, u in streamed] == [MAX_TOKENS] * NUM_CLIENTS
    assert [t for t, _ in streamed] == refs
    assert len(set(refs)) > NUM_CLIENTS // 2, "prompts should give distinct continuations"
    server.wait_idle()


def _aborts(server: LiveServer) -> float:
    return server.metrics().get("kvloop:request_success_total{abort}", 0.0)


def test_disconnect_mid_stream_frees_the_request(server: LiveServer) -> None:
    before = _aborts(server)
    body = {"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 200, "stream": True,
            "ignore_eos": True, "temperature": 0.0}
    with patched_execute(server.engine, slow_steps(0.01)):
        with httpx.Client(timeout=30) as http, \
                http.stream("POST", f"{server.base_url}/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(4)]
            assert any(line.startswith("data: {") for line in got)
            assert server.metrics()["kvloop:num_requests_running"] == 1
        # leaving the blocks closes the connection mid-stream
        m = server.wait_idle()
    assert m["kvloop:num_requests_running"] == 0
    assert m["kvloop:kv_cache_usage_perc"] == 0
    assert _aborts(server) == before + 1


def test_disconnect_while_waiting_for_a_non_streamed_reply(server: LiveServer) -> None:
    before = _aborts(server)
    body = {"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 200,
            "ignore_eos": True}
    with patched_execute(server.engine, slow_steps(0.01)):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.base_url}/completions", json=body, timeout=0.4)
        m = server.wait_idle()
    assert m["kvloop:num_requests_running"] == 0
    assert m["kvloop:kv_cache_usage_perc"] == 0
    assert _aborts(server) == before + 1


def test_server_keeps_serving_after_disconnects(server: LiveServer) -> None:
    t0 = time.monotonic()
    r = httpx.post(f"{server.base_url}/completions", json={
        "model": MODEL_NAME, "prompt": "hello", "max_tokens": 3, "ignore_eos": True},
        timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert time.monotonic() - t0 < 5
