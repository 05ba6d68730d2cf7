"""``kvloop generate``: defaults shown and taken from the generation config, streaming, status
lines, logprobs (text and JSON) and the [length] note."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

from kvloop.cli import main  # noqa: E402
from kvloop.cli.main import build_parser  # noqa: E402
from server.serverkit import build_tiny_model  # noqa: E402

FLAGS = ["--dtype", "float32", "--device", "cpu", "--num-gpu-blocks", "64",
         "--max-model-len", "256", "--swap-space", "0"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    config = json.loads((folder / "generation_config.json").read_text())
    config.update(temperature=0.0, max_new_tokens=4)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def _run(capsys, model_dir: Path, *args: str) -> tuple[int, str, str]:
    rc = main(["generate", "--model", str(model_dir), *FLAGS, *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_help_shows_the_defaults():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    text = sub.choices["generate"].format_help()
    for flag in ("--max-tokens", "--temperature", "--top-p", "--top-k", "--min-p",
                 "--repetition-penalty", "--generation-config"):
        assert flag in text
    flat = " ".join(text.split())
    assert "(default: the model's generation config; --model default: 64; else 16)" in flat
    assert "--model default: 0.0; else 1.0" in flat
    assert "'vllm', vLLM's neutral ones" in flat


def test_generation_config_defaults_and_status_lines(capsys, model_dir):
    rc, out, err = _run(capsys, model_dir, "--prompt", "the quick", "--ignore-eos")
    assert rc == 0
    lines = err.splitlines()
    assert lines[0].startswith("kvloop: loading ")
    assert lines[1].startswith("kvloop: loaded in ") and "float32 on cpu" in lines[1]
    assert lines[2].startswith("kvloop: KV cache: 64 blocks x 16 tokens = 1024 tokens")
    assert "temperature=0.0" in lines[3] and "max_tokens=4" in lines[3]
    assert "temperature=0.0 max_tokens=4 (the model's generation_config.json)" in lines[3]
    assert "repetition_penalty=1.0 (vLLM's neutral defaults)" in lines[3]
    assert "kvloop: [length] the reply stopped at 4 tokens" in lines[4]
    assert out.endswith("\n") and out.strip()

    # explicit flags win; --generation-config vllm gives the neutral defaults
    rc, out2, _err2 = _run(capsys, model_dir, "--prompt", "the quick", "--ignore-eos",
                          "--max-tokens", "2", "--json")
    assert json.loads(out2)["finish_reason"] == "length"
    assert len(json.loads(out2)["token_ids"]) == 2
    rc, out3, err3 = _run(capsys, model_dir, "--prompt", "the quick", "--ignore-eos",
                          "--generation-config", "vllm", "--json")
    assert len(json.loads(out3)["token_ids"]) == 16
    assert "temperature=1.0" in err3 and "vLLM's neutral defaults" in err3


def test_bad_flags_fail_before_loading(capsys, model_dir):
    rc, _out, err = _run(capsys, model_dir, "--prompt", "x", "--top-p", "0")
    assert rc == 2 and "top_p must be in (0, 1]" in err and "loading" not in err


def test_logprobs_printed_and_in_json(capsys, model_dir):
    rc, out, _err = _run(capsys, model_dir, "--prompt", "the quick", "--ignore-eos",
                        "--logprobs", "2")
    assert rc == 0
    _head, table = out.split("logprobs (token: logprob | top alternatives):\n")
    rows = table.splitlines()
    assert len(rows) == 4
    for i, row in enumerate(rows):
        index, rest = row.split(maxsplit=1)
        assert int(index) == i and rest.count("|") == 1
        assert len(rest.split("|")[1].split(",")) == 2  # the top 2

    rc, out, _err = _run(capsys, model_dir, "--prompt", "the quick", "--ignore-eos",
                        "--logprobs", "2", "--json")
    data = json.loads(out)
    assert len(data["logprobs"]) == len(data["token_ids"]) == 4
    for tid, entry in zip(data["token_ids"], data["logprobs"], strict=True):
        top = entry["top_logprobs"]
        assert entry["token_id"] == tid and len(top) == 2
        assert top[0]["token_id"] == tid  # greedy: the sampled token is the best
        assert math.isclose(top[0]["logprob"], entry["logprob"])
        assert top[0]["logprob"] >= top[1]["logprob"]
        assert isinstance(entry["token"], str)


def test_a_batch_prints_each_completion_as_it_finishes(capsys, model_dir):
    rc, out, err = _run(capsys, model_dir, "--prompt", "the quick", "--prompt",
                        "hello world", "--ignore-eos", "--max-tokens", "3")
    assert rc == 0
    lines = out.splitlines()
    assert sorted(line[:4] for line in lines) == ["[0] ", "[1] "]
    assert err.count("[length]") == 2 and "(prompt 0)" in err and "(prompt 1)" in err
    rc, out, err = _run(capsys, model_dir, "--prompt", "the quick", "--prompt",
                        "hello world", "--json")
    assert sorted(json.loads(line)["index"] for line in out.splitlines()) == [0, 1]


def test_one_prompt_streams_its_tokens(monkeypatch, capsys, model_dir):
    import io
    import sys

    class Recorder(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.writes: list[str] = []

        def write(self, s: str) -> int:
            self.writes.append(s)
            return super().write(s)

    out = Recorder()
    monkeypatch.setattr(sys, "stdout", out)
    # token ids: a random tiny model's text may be held back as incomplete UTF-8
    assert main(["generate", "--model", str(model_dir), *FLAGS, "--prompt", "5,17,99",
                 "--skip-tokenizer-init", "--ignore-eos", "--max-tokens", "4"]) == 0
    pieces = [w for w in out.writes if w.strip()]
    assert len(pieces) == 4  # one write per step, as generated
    assert len(out.getvalue().split()) == 4 and out.getvalue().endswith("\n")


def test_max_tokens_over_the_model_length_fails_before_loading(tmp_path, capsys):
    import json

    from kvloop.cli import main

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 32}))
    rc = main(["generate", "--model", str(tmp_path), "--prompt", "hi", "--max-tokens", "40"])
    assert rc == 2 and "max" in capsys.readouterr().err  # no weights: it never loaded
