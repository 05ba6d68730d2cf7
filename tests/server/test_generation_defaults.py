"""The server takes a request's unset sampling fields from the model's generation config
(vLLM's ``--generation-config auto``); ``vllm`` keeps the neutral ones."""

from __future__ import annotations

import json

import httpx
import pytest
from serverkit import build_tiny_model, start_server


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    (path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "max_new_tokens": 3, "bos_token_id": 1}))
    return path


def test_unset_fields_come_from_the_generation_config(model) -> None:
    live = start_server(model)
    try:
        url = f"{live.base_url}/completions"
        a = httpx.post(url, json={"prompt": "hello", "ignore_eos": True}, timeout=60).json()
        b = httpx.post(url, json={"prompt": "hello", "ignore_eos": True}, timeout=60).json()
        assert a["usage"]["completion_tokens"] == 3  # max_new_tokens
        assert a["choices"][0]["text"] == b["choices"][0]["text"]  # temperature 0
        c = httpx.post(url, json={"prompt": "hello", "ignore_eos": True, "max_tokens": 5},
                       timeout=60).json()
        assert c["usage"]["completion_tokens"] == 5  # a field given wins
    finally:
        live.stop()


def test_vllm_keeps_the_neutral_defaults(model) -> None:
    live = start_server(model, generation_config="vllm")
    try:
        r = httpx.post(f"{live.base_url}/completions",
                       json={"prompt": "hello", "ignore_eos": True}, timeout=60).json()
        assert r["usage"]["completion_tokens"] > 3  # up to the rest of the context
    finally:
        live.stop()
