"""``n > 1`` over HTTP: n choices, streamed with their index, usage over all of them, and
nothing left behind."""

from __future__ import annotations

import json

import httpx
import pytest
from serverkit import LiveServer, build_tiny_model, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    live = start_server(build_tiny_model(tmp_path_factory.mktemp("tiny")))
    yield live
    live.stop()


def _post(server: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def test_greedy_choices_are_identical_and_usage_counts_them_all(server: LiveServer) -> None:
    body = {"prompt": "hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    one = _post(server, "/completions", body).json()
    two = _post(server, "/completions", {**body, "n": 2}).json()
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert {c["text"] for c in two["choices"]} == {one["choices"][0]["text"]}
    assert two["usage"]["completion_tokens"] == 12
    assert two["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]


def test_seeded_choices_are_reproducible(server: LiveServer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "n": 3,
            "seed": 11, "temperature": 1.0}
    a = _post(server, "/chat/completions", body).json()
    b = _post(server, "/chat/completions", body).json()
    texts = [c["message"]["content"] for c in a["choices"]]
    assert texts == [c["message"]["content"] for c in b["choices"]]
    assert len(set(texts)) > 1


def test_streamed_choices_carry_their_index(server: LiveServer) -> None:
    body = {"prompt": "hello", "max_tokens": 5, "n": 2, "stream": True, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    texts = {0: "", 1: ""}
    finished = set()
    usage = None
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk["choices"]:
                texts[c["index"]] += c["text"]
                if c["finish_reason"]:
                    finished.add(c["index"])
    assert finished == {0, 1} and texts[0] == texts[1]
    assert usage is not None and usage["completion_tokens"] == 10
    metrics = httpx.get(f"{server.base_url.removesuffix('/v1')}/metrics", timeout=10).text
    assert "kvloop:kv_cache_usage_perc" in metrics
