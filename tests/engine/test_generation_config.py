"""Default sampling from generation_config.json (vLLM's --generation-config auto|vllm|PATH):
what is read, the offline API's defaults, explicit parameters winning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvloop import SamplingParams
from kvloop.engine.generation_config import (
    DEFAULT_MODEL_GENERATION_CONFIG,
    default_sampling_fields,
    read_generation_config,
    sampling_defaults,
)

MODEL_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.0,
                "top_p": 0.8, "top_k": 20, "min_p": None, "repetition_penalty": 1.05,
                "max_new_tokens": 5, "max_length": 99, "transformers_version": "5.24.0"}


def _folder(root: Path, config: dict | None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (root / "generation_config.json").write_text(json.dumps(config))
    return root


def test_fields_taken_as_vllm_takes_them(tmp_path):
    folder = _folder(tmp_path / "m", MODEL_CONFIG)
    fields = default_sampling_fields("auto", folder)
    # vLLM's keys only, nulls skipped, max_new_tokens as max_tokens; do_sample etc. ignored
    assert fields == {"temperature": 0.0, "top_p": 0.8, "top_k": 20,
                      "repetition_penalty": 1.05, "max_tokens": 5}
    assert default_sampling_fields("vllm", folder) == {}
    assert default_sampling_fields("auto", _folder(tmp_path / "none", None)) == {}
    assert default_sampling_fields("auto", _folder(tmp_path / "eos", {"eos_token_id": 2})) == {}


def test_a_path_names_a_file_or_its_folder(tmp_path):
    other = _folder(tmp_path / "other", {"temperature": 0.7})
    model = _folder(tmp_path / "m", MODEL_CONFIG)
    assert default_sampling_fields(str(other), model) == {"temperature": 0.7}
    assert default_sampling_fields(str(other / "generation_config.json"), model) == {
        "temperature": 0.7}
    with pytest.raises(ValueError, match="no such file"):
        default_sampling_fields(str(tmp_path / "missing"), model)
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must be a JSON object"):
        read_generation_config(str(tmp_path / "bad.json"), model)
    with pytest.raises(ValueError, match=r"generation config: top_p must be in \(0, 1\]"):
        sampling_defaults({"top_p": 0.0})


def test_the_default_model_has_kvloops_settings_under_auto(tmp_path):
    folder = _folder(tmp_path / "m", {"eos_token_id": 2})
    fields = default_sampling_fields("auto", folder, model="default")
    assert fields == sampling_defaults(DEFAULT_MODEL_GENERATION_CONFIG)
    assert SamplingParams(**fields).greedy
    assert default_sampling_fields("vllm", folder, model="default") == {}
    own = _folder(tmp_path / "own", {"temperature": 0.5})  # the folder's file wins
    assert default_sampling_fields("auto", own, model="default")["temperature"] == 0.5


# -- the offline API on a tiny real model ----------------------------------------------
transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

from kvloop.engine.llm import LLM  # noqa: E402
from server.serverkit import ENGINE_ARGS, build_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    config = json.loads((folder / "generation_config.json").read_text())
    config.update(temperature=0.0, max_new_tokens=5)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), **ENGINE_ARGS)


def test_no_params_means_the_models_defaults(llm: LLM):
    defaults = llm.get_default_sampling_params()
    assert defaults.temperature == 0.0 and defaults.max_tokens == 5
    assert defaults.top_p == SamplingParams().top_p  # the rest stays neutral
    prompts = ["the quick brown fox", "hello world"]
    implicit = llm.generate(prompts, use_tqdm=False)
    explicit = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5),
                            use_tqdm=False)
    assert [o.token_ids for o in implicit] == [o.token_ids for o in explicit]
    chat = llm.chat([{"role": "user", "content": "hello"}], use_tqdm=False)
    assert chat[0].num_output_tokens <= 5


def test_explicit_params_win(llm: LLM):
    (out,) = llm.generate("the quick", SamplingParams(max_tokens=3, ignore_eos=True),
                          use_tqdm=False)
    assert len(out.token_ids) == 3  # not the model's 5
    params = llm.get_default_sampling_params()
    params.max_tokens = 7  # a copy: the defaults are not changed
    assert llm.get_default_sampling_params().max_tokens == 5


def test_vllm_means_neutral_defaults(model_dir: Path):
    llm = LLM(str(model_dir), generation_config="vllm", **ENGINE_ARGS)
    assert llm.get_default_sampling_params() == SamplingParams()
    assert llm.default_sampling == {}


def test_on_output_streams_deltas(llm: LLM):
    seen: dict[int, list] = {}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(["the quick", "hello world, how"], params, use_tqdm=False,
                        on_output=lambda i, o: seen.setdefault(i, []).append(o))
    for i, final in enumerate(outs):
        deltas = seen[i]
        assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
        assert [t for d in deltas for t in d.new_token_ids] == final.token_ids
        assert "".join(d.new_text for d in deltas) == final.text
