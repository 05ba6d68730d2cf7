"""Prompts are parsed, templated and tokenized on worker threads: a slow tokenization never
holds up ``/health`` or the streams in flight; a full backlog is a 429; a text too long for
any prompt is refused before the tokenizer sees it.

The slow tokenizer is a test hook (a wrapper whose ``encode`` sleeps or waits on a gate),
not the timing of a real one. ``time.sleep`` releases the GIL as the Rust tokenizer does
while it encodes, so the hook stands for a long real encode.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serverkit import MODEL_NAME, LiveServer, patched_execute, slow_steps

from kvloop.engine.intake import max_token_chars
from kvloop.server.errors import APIError
from kvloop.server.prompt_workers import PromptWorkers


class HookedTokenizer:
    """The real tokenizer, with ``encode`` (which chats use too, after the template) counted
    and delayed by ``delay`` seconds or held until ``gate`` is set."""

    def __init__(self, inner: Any, delay: float = 0.0, gate: threading.Event | None = None
                 ) -> None:
        self.inner = inner
        self.delay = delay
        self.gate = gate
        self.calls = 0
        self.entered = threading.Event()

    def _hold(self) -> None:
        self.calls += 1
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(20)
        time.sleep(self.delay)

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        self._hold()
        return self.inner.encode(prompt, add_special_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@contextlib.contextmanager
def hooked(live: LiveServer, **kwargs: Any) -> Iterator[HookedTokenizer]:
    serving = live.serving
    original = serving.tokenizer
    serving.tokenizer = serving.encoder.tokenizer = hook = HookedTokenizer(original, **kwargs)
    try:
        yield hook
    finally:
        serving.tokenizer = serving.encoder.tokenizer = original


STREAM = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 80, "ignore_eos": True,
          "stream": True}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_slow_tokenization_blocks_neither_health_nor_streams(server: LiveServer,
                                                             chat: bool) -> None:
    """While one prompt takes 3 s to encode, /health answers at once and a stream in
    flight keeps receiving tokens. (NOTE: bounds at half the delay and more, so that a
    loaded 2-core machine passes and inline encoding still fails.)"""
    delay = 3.0
    big = "the quick brown fox jumps over the lazy dog " * 4
    slow_body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 2}
    if chat:
        slow_body["messages"] = [{"role": "user", "content": big}]
    else:
        slow_body["prompt"] = big
    path = "/chat/completions" if chat else "/completions"

    async def scenario() -> tuple[list[float], list[float], float, httpx.Response, int]:
        chunk_times: list[float] = []
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            first = asyncio.Event()

            async def stream() -> None:
                async with http.stream("POST", "/completions", json=STREAM) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            chunk_times.append(time.monotonic())
                            first.set()

            streaming = asyncio.create_task(stream())
            await asyncio.wait_for(first.wait(), 20)
            with hooked(server, delay=delay) as hook:  # the stream's prompt is encoded
                slow = asyncio.create_task(http.post(path, json=slow_body))
                while not hook.entered.is_set():
                    await asyncio.sleep(0.01)
                t_start = time.monotonic()
                latencies = []
                for _ in range(5):
                    t0 = time.monotonic()
                    r = await http.get(f"{server.url}/health")
                    assert r.status_code == 200
                    latencies.append(time.monotonic() - t0)
                    await asyncio.sleep(0.15)
                response = await slow
            await streaming
        return latencies, chunk_times, t_start, response, hook.calls

    with patched_execute(server.engine, slow_steps(0.02)):
        latencies, chunk_times, t_start, response, calls = asyncio.run(scenario())
    assert response.status_code == 200, response.text
    assert calls == 1
    assert max(latencies) < delay / 2, latencies  # inline encoding would take ~3 s
    during = [t for t in chunk_times if t_start <= t <= t_start + delay - 0.2]
    assert len(during) >= 5, (len(during), len(chunk_times))


def test_full_backlog_is_a_429(new_server) -> None:
    live = new_server(server_config={"prompt_workers": 1, "max_prompt_backlog": 1})
    workers = live.app.state.prompt_workers
    gate = threading.Event()
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}

    async def scenario(hook: HookedTokenizer) -> tuple[httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=live.base_url, timeout=30) as http:
            running = asyncio.create_task(http.post("/completions", json=body))
            waiting = asyncio.create_task(http.post("/completions", json=body))
            while workers.in_flight < 2:  # one on the worker, one in the backlog
                await asyncio.sleep(0.01)
            assert hook.entered.is_set()
            refused = await http.post("/completions", json=body)
            gate.set()
            return refused, [await running, await waiting]

    try:
        with hooked(live, gate=gate) as hook:
            refused, served = asyncio.run(scenario(hook))
    finally:
        gate.set()
    assert refused.status_code == 429, refused.text
    err = refused.json()["error"]
    assert err["code"] == 429 and "encoding prompts" in err["message"]
    assert int(refused.headers["retry-after"]) >= 1
    assert [r.status_code for r in served] == [200, 200]
    assert workers.in_flight == 0


def test_text_too_long_for_any_prompt_is_refused_before_tokenizing(server: LiveServer) -> None:
    serving = server.serving
    limit = (serving.limits.max_total_tokens - 1) * serving.token_chars
    with hooked(server) as hook:
        for text in ("x" * (limit + 1), "hello " * (limit // 6 + 1)):
            r = httpx.post(f"{server.base_url}/completions", json={"prompt": text}, timeout=30)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "prompt" and "characters" in err["message"]
            assert "the model takes at most" in err["message"]
        messages = [{"role": "user", "content": "x" * (limit // 2 + 1)}] * 2
        r = httpx.post(f"{server.base_url}/chat/completions", json={"messages": messages})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert hook.calls == 0
        # at the bound, the tokenizer decides (here: too many tokens, after encoding)
        r = httpx.post(f"{server.base_url}/completions", json={"prompt": "x" * limit})
        assert r.status_code == 400 and hook.calls == 1
        assert "characters" not in r.json()["error"]["message"]


def test_token_chars_bounds_real_encodings(server: LiveServer) -> None:
    """No text encodes to fewer than len(text) / max_token_chars tokens (random texts over
    the tiny tokenizer's alphabet, its long tokens and special tokens included)."""
    tok = server.serving.tokenizer
    bound = max_token_chars(tok)
    assert bound == max(len(t) for t in tok.hf.get_vocab())
    longest = sorted(tok.hf.get_vocab(), key=len)[-20:]
    pieces = [*"abcdefghijklmnopqrstuvwxyz0123456789 ,.?:;\n", "the ", " over", "é", "日本",
              "<|im_start|>", "<|im_end|>", *(t.replace("Ġ", " ") for t in longest)]
    rng = random.Random(11)
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 60)))
        assert len(tok.encode(text)) * bound >= len(text), text


def test_max_token_chars_without_a_vocabulary() -> None:
    class Bare:
        def encode(self, prompt: str) -> list[int]:
            return [1]

    assert max_token_chars(Bare()) is None


def test_cancelled_waiting_work_never_runs_and_is_not_counted() -> None:
    async def scenario() -> None:
        workers = PromptWorkers(workers=1, max_backlog=1)
        gate = threading.Event()
        ran: list[str] = []

        def blocked() -> str:
            gate.wait(10)
            ran.append("a")
            return "a"

        first = asyncio.create_task(workers.run(blocked))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(workers.run(lambda: ran.append("b") or "b"))
        await asyncio.sleep(0.05)
        assert workers.in_flight == 2
        with pytest.raises(APIError) as info:
            await workers.run(lambda: "c")
        assert info.value.status == 429
        second.cancel()
        await asyncio.sleep(0.05)
        assert workers.in_flight == 1
        gate.set()
        assert await first == "a"
        assert workers.in_flight == 0 and ran == ["a"]
        workers.shutdown()

    asyncio.run(scenario())


def test_prompt_char_bound_is_exact_at_its_edge() -> None:
    from kvloop.engine.intake import EngineLimits, check_prompt_chars, max_prompt_chars
    from kvloop.errors import InvalidRequestError

    limits = EngineLimits(max_model_len=100, kv_cache_tokens=64)  # 63 prompt tokens at most
    assert max_prompt_chars(limits, 10) == 630 and max_prompt_chars(limits, None) is None
    check_prompt_chars(630, limits, 10)  # 63 tokens of 10 characters could still fit
    check_prompt_chars(10**9, limits, None)  # no bound known: the tokenizer decides
    with pytest.raises(InvalidRequestError, match="at least 64 tokens") as info:
        check_prompt_chars(631, limits, 10, "messages")
    assert info.value.field == "messages"


def test_long_texts_are_encoded_at_the_lowest_priority() -> None:
    """A text over ``LONG_TEXT_CHARS`` is encoded on a nice-19 thread (Linux), a short one
    on the caller's; both give the tokenizer's ids, and the caller keeps its priority."""
    import os
    import sys

    from kvloop.server.prompt_workers import LONG_TEXT_CHARS, BackgroundEncoder

    class Recording:
        def __init__(self) -> None:
            self.seen: list[tuple[int, int]] = []

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            tid = threading.get_native_id()
            self.seen.append((tid, os.getpriority(os.PRIO_PROCESS, tid)))
            return [len(text), int(add_special_tokens)]

    tok = Recording()
    encoder = BackgroundEncoder(tok)
    try:
        assert encoder.encode("short") == [5, 1]
        assert encoder.encode("x" * (LONG_TEXT_CHARS + 1), False) == [LONG_TEXT_CHARS + 1, 0]
    finally:
        encoder.shutdown()
    (short_tid, short_nice), (long_tid, long_nice) = tok.seen
    me = threading.get_native_id()
    assert short_tid == me and long_tid != me
    assert short_nice == os.getpriority(os.PRIO_PROCESS, me)
    if sys.platform == "linux":
        assert long_nice == 19
    assert encoder.token_floor is None  # NOTE: the tokenizer has none
