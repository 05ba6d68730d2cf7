"""The official ``openai`` client against a live server: completions, chat, streaming, usage,
stop strings, seeds, logprobs, and the small GET endpoints."""

from __future__ import annotations

import httpx
import pytest
from serverkit import MODEL_NAME, LiveServer

openai = pytest.importorskip("openai")

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def _prompt_len(server: LiveServer, prompt: str) -> int:
    return len(server.engine.tokenizer.encode(prompt))


def test_completion_usage_and_length(client: openai.OpenAI, server: LiveServer) -> None:
    prompt = "the quick brown fox"
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=7, **GREEDY)
    choice = r.choices[0]
    assert r.object == "text_completion" and r.model == MODEL_NAME
    assert choice.finish_reason == "length" and isinstance(choice.text, str)
    assert r.usage.completion_tokens == 7
    assert r.usage.prompt_tokens == _prompt_len(server, prompt)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_completion_from_token_ids(client: openai.OpenAI, server: LiveServer) -> None:
    ids = server.engine.tokenizer.encode("hello world")
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=5, **GREEDY)
    by_text = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=5,
                                        **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_streamed_completion_matches_non_streamed(client: openai.OpenAI) -> None:
    kw = {"model": MODEL_NAME, "prompt": "numbers 0123", "max_tokens": 9, **GREEDY}
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True,
                                            stream_options={"include_usage": True}, **kw))
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 9
    assert usage.usage.prompt_tokens == full.usage.prompt_tokens
    text = "".join(c.choices[0].text for c in chunks[:-1])
    assert text == full.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"


def test_chat_and_chat_stream(client: openai.OpenAI, server: LiveServer) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    kw = {"model": MODEL_NAME, "messages": messages, "max_tokens": 6, **GREEDY}
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.object == "chat.completion" and msg.role == "assistant"
    expected_prompt = len(server.engine.tokenizer.apply_chat_template(messages))
    assert r.usage.prompt_tokens == expected_prompt and r.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []
    assert chunks[-2].choices[0].finish_reason == "length"
    alias = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                           max_completion_tokens=3, temperature=0.0,
                                           extra_body={"ignore_eos": True})
    assert alias.usage.completion_tokens == 3


def test_chat_with_text_parts(client: openai.OpenAI) -> None:
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    a = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user",
                                       "content": parts}], max_tokens=4, **GREEDY)
    b = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user",
                                       "content": "hello"}], max_tokens=4, **GREEDY)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_stop_string(client: openai.OpenAI) -> None:
    kw = {"model": MODEL_NAME, "prompt": "hello world", **GREEDY}
    full = client.completions.create(max_tokens=24, **kw).choices[0].text
    assert len(full) >= 8, full
    stop = full[4:7]
    expected = full[: full.find(stop)]
    r = client.completions.create(max_tokens=24, stop=[stop], **kw)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        max_tokens=24, stop=stop, stream=True, **kw))
    assert streamed == expected


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    kw = {"model": MODEL_NAME, "prompt": "paged attention", "max_tokens": 12,
          "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    assert a == b
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert others - {a}, "different seeds should give a different sample"


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=5, logprobs=3,
                                  **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and 1 <= len(top) <= 4
        assert value == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the argmax
        assert top.get(tok) == pytest.approx(value, abs=1e-5)
    streamed = list(client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=5,
                                              logprobs=3, stream=True, **GREEDY))
    tokens = [t for c in streamed for t in (c.choices[0].logprobs.tokens or [])]
    assert tokens == lp.tokens


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        logprobs=True, top_logprobs=2, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-5)
        assert item.bytes == list(item.token.encode())


def test_models_health_version(server: LiveServer, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert httpx.get(f"{server.url}/health").status_code == 200
    v = httpx.get(f"{server.url}/version").json()
    import kvloop

    assert v == {"version": kvloop.__version__}


def test_default_max_tokens_is_the_rest_of_the_context(server: LiveServer) -> None:
    ids = list(range(5, 5 + 240))  # max_model_len 256: room for 16 tokens
    body = {"model": MODEL_NAME, "prompt": ids, "temperature": 0.0, "ignore_eos": True}
    r = httpx.post(f"{server.base_url}/completions", json=body, timeout=30).json()
    assert r["usage"]["completion_tokens"] == 256 - 240
    assert r["choices"][0]["finish_reason"] == "length"


def test_vllm_extras_and_continuous_usage(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=3,
                                  temperature=0.0, extra_body={"ignore_eos": True,
                                  "priority": 5, "cache_salt": "tenant-a", "top_k": 5,
                                  "min_p": 0.1, "repetition_penalty": 1.1})
    assert r.usage.completion_tokens == 3
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt="hello", max_tokens=3, stream=True, **GREEDY,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 3
