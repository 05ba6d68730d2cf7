"""vLLM's prompt forms in ``LLM.generate``: ``{"prompt": str}`` and ``{"prompt_token_ids": [...]}``,
alone or in lists mixed with plain strings and id lists."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

from kvloop import SamplingParams
from kvloop.engine.llm import LLM
from kvloop.errors import InvalidRequestError
from server.serverkit import ENGINE_ARGS, build_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path: Path = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    return LLM(str(path), **ENGINE_ARGS)


def test_single_dict_prompts(llm: LLM):
    (by_text,) = llm.generate({"prompt": "the quick brown fox"}, GREEDY, use_tqdm=False)
    assert by_text.prompt == "the quick brown fox"
    ids = by_text.prompt_token_ids
    (by_ids,) = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert by_ids.prompt is None and by_ids.prompt_token_ids == ids
    assert by_ids.token_ids == by_text.token_ids and by_ids.text == by_text.text


def test_mixed_batch_keeps_input_order(llm: LLM):
    tok = llm.get_tokenizer()
    texts = ["hello world", "the lazy dog", "numbers 0123", "paged attention"]
    ids = tok.encode(texts[3])
    batch = [texts[0], {"prompt": texts[1]}, {"prompt_token_ids": tok.encode(texts[2])}, ids]
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    alone = llm.generate(texts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    assert [o.prompt for o in outs] == [texts[0], texts[1], None, None]


@pytest.mark.parametrize("bad", [
    {"prompt_token_ids": [1, 2], "prompt": "both"},
    {"prompt": ""},
    {"prompt_token_ids": [10**6]},
    {"prompt_token_ids": ["a"]},
    {"text": "wrong key"},
])
def test_bad_dict_prompt_names_prompt_and_queues_nothing(llm: LLM, bad: dict):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(["fine prompt", bad], GREEDY, use_tqdm=False)
    assert info.value.field == "prompt"
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats().kv_usage == 0.0


def test_per_prompt_lists_must_match(llm: LLM):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)
    assert info.value.field == "sampling_params"
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(["a", "b"], GREEDY, priority=[1], use_tqdm=False)
    assert info.value.field == "priority"
