"""``skip_tokenizer_init``: a model folder without a tokenizer runs on token ids, offline and
served."""

from __future__ import annotations

import json

import pytest

from conftest import TinyModel
from kvloop import SamplingParams
from kvloop.engine.llm import LLM
from kvloop.errors import InvalidRequestError

ARGS = {"dtype": "float32", "device": "cpu", "block_size": 4, "num_gpu_blocks": 64,
        "swap_space": 0.0, "max_model_len": 256, "max_num_seqs": 8}


@pytest.fixture(scope="module")
def llm(llama_model: TinyModel) -> LLM:
    return LLM(str(llama_model.path), skip_tokenizer_init=True, **ARGS)


def test_the_folder_has_no_tokenizer(llama_model: TinyModel):
    assert not list(llama_model.path.glob("tokenizer*"))
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(str(llama_model.path), **ARGS)


def test_token_ids_in_token_ids_out(llm: LLM, llama_model: TinyModel):
    assert llm.get_tokenizer() is None
    prompts = [[5, 17, 99, 3], [42, 7]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([prompts[0], {"prompt_token_ids": prompts[1]}], params, use_tqdm=False)
    for out, prompt in zip(outs, prompts, strict=True):
        assert out.prompt_token_ids == prompt and out.prompt is None
        assert out.token_ids == llama_model.greedy(prompt, 6)
        assert out.text == "" and out.finish_reason == "length"
    (single,) = llm.generate(prompts[1], params, use_tqdm=False)
    assert single.token_ids == outs[1].token_ids


@pytest.mark.parametrize(("call", "field"), [
    (lambda llm: llm.generate("some text", use_tqdm=False), "prompt"),
    (lambda llm: llm.generate({"prompt": "some text"}, use_tqdm=False), "prompt"),
    (lambda llm: llm.generate([1, 2], SamplingParams(stop=["x"]), use_tqdm=False), "stop"),
    (lambda llm: llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False), "messages"),
])
def test_what_needs_a_tokenizer_is_refused_clearly(llm: LLM, call, field: str):
    with pytest.raises(InvalidRequestError) as info:
        call(llm)
    assert info.value.field == field and "tokenizer" in info.value.message
    assert not llm.engine.has_unfinished_requests()


def test_served_without_a_tokenizer(llama_model: TinyModel):
    serverkit = pytest.importorskip("server.serverkit")
    import httpx

    live = serverkit.start_server(llama_model.path, skip_tokenizer_init=True)
    try:
        url = f"{live.base_url}/completions"
        body = {"prompt": [5, 17, 99, 3], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        ok = httpx.post(url, json=body, timeout=60)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 5
        # NOTE: no tokenizer, no text: the choice carries the token ids (vLLM's token_ids).
        assert ok.json()["choices"][0]["token_ids"] == llama_model.greedy([5, 17, 99, 3], 5)
        streamed = httpx.post(url, json={**body, "stream": True}, timeout=60).text
        ids = [t for line in streamed.splitlines() if line.startswith("data: {")
               for t in json.loads(line[6:])["choices"][0].get("token_ids", [])]
        assert ids == llama_model.greedy([5, 17, 99, 3], 5)
        for path, bad in [("/completions", {"prompt": "text"}),
                          ("/chat/completions", {"messages": [{"role": "user",
                                                               "content": "hi"}]})]:
            r = httpx.post(f"{live.base_url}{path}", json=bad, timeout=60)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == ("prompt" if path == "/completions" else "messages")
            assert "tokenizer" in err["message"]
    finally:
        live.stop()


def test_generate_command_takes_and_prints_token_ids(llama_model: TinyModel, capsys):
    from kvloop.cli import main

    flags = ["--model", str(llama_model.path), "--skip-tokenizer-init", "--dtype", "float32",
             "--device", "cpu", "--num-gpu-blocks", "64", "--block-size", "4",
             "--max-model-len", "256", "--max-tokens", "5", "--ignore-eos", "--temperature", "0"]
    assert main(["generate", *flags, "--prompt", "5,17,99,3"]) == 0
    printed = capsys.readouterr().out.split()
    assert [int(t) for t in printed] == llama_model.greedy([5, 17, 99, 3], 5)
    assert main(["generate", *flags, "--prompt", "hello"]) == 2
    assert "must be token ids" in capsys.readouterr().err
