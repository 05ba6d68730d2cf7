"""CLI polish: no flag abbreviations, ``--version``, the subcommand's usage
on an unknown flag, sizes with units, the port checked before the model loads, and
``--max-tokens`` checked against the model's length before it loads."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvloop.cli import main
from kvloop.cli.args import (
    check_max_tokens_early,
    format_size,
    local_model_config,
    parse_size,
    size_gib,
)
from kvloop.cli.main import build_parser


def _parsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every parser of the command tree, by prog."""
    yield parser.prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def _fails(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run ``kvloop argv`` expecting argparse's exit 2; its stderr."""
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_no_parser_takes_abbreviations() -> None:
    progs = dict(_parsers(build_parser()))
    assert {"kvloop", "kvloop serve", "kvloop simulate", "kvloop trace plot",
            "kvloop bench serve"} <= set(progs)
    assert all(p.allow_abbrev is False for p in progs.values())


@pytest.mark.parametrize("argv, prog", [
    (["simulate", "--rate", "2"], "kvloop simulate"),
    (["bench", "serve", "--rate", "2"], "kvloop bench serve"),
    (["serve", "--max-num-seq", "2"], "kvloop serve"),
])
def test_a_prefix_is_an_unknown_flag(capsys: pytest.CaptureFixture[str], argv: list[str],
                                     prog: str) -> None:
    err = _fails(capsys, *argv)
    last = err.strip().splitlines()[0]
    assert last.startswith(f"{prog}: error: unrecognized arguments: {argv[-2]} 2")
    if argv[-2] == "--rate":  # the flags abbreviation would have picked, and a near one
        assert "(did you mean --rate-scale or --request-rate?)" in last


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvloop {importlib.metadata.version('kvloop')}"


@pytest.mark.parametrize("argv", [
    ["serve", "--bogus"],
    ["generate", "--prompt", "hi", "--temp", "0"],
    ["trace", "plot", "steps.jsonl", "--bogus=1"],
    ["profile", "--prot", "3"],
    ["generate", "--prompt", "hi", "--temperature", "hot"],
    ["generate", "--prompt", "hi", "--dtype", "fp16"],
])
def test_bad_flags_print_two_lines_not_the_usage(capsys: pytest.CaptureFixture[str],
                                                 argv: list[str]) -> None:
    err = _fails(capsys, *argv)
    prog = "kvloop " + " ".join(a for a in argv[:2] if a in ("serve", "generate", "trace",
                                                               "plot", "profile"))
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith(f"{prog}: error: ")
    assert argv[-1].split("=")[0] in lines[0]  # the flag (and the value)
    assert lines[1] == f"(run '{prog} --help' for every flag and its choices)"
    assert "usage:" not in err and "Traceback" not in err
    if argv[-1] == "fp16":
        assert "'bfloat16'" in lines[0]  # the choices


def test_unknown_flag_hints() -> None:
    text = subprocess.run([sys.executable, "-m", "kvloop.cli", "generate", "--prompt", "x",
                           "--temp", "0"], capture_output=True, text=True)
    assert text.returncode == 2
    assert text.stderr.strip().splitlines()[0] == (
        "kvloop generate: error: unrecognized arguments: --temp 0 (did you mean "
        "--temperature?)")


@pytest.mark.parametrize("text, size", [
    ("1073741824", 1 << 30), ("1GiB", 1 << 30), ("512MiB", 512 << 20), ("2GB", 2 * 10**9),
    ("1.5gib", 3 << 29), ("64K", 64 << 10), ("64 KiB", 64 << 10), ("10mb", 10**7),
    ("1T", 1 << 40), ("0", 0), ("100B", 100),
])
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "-1", "1e9", "1GiBs", "1.2.3", "1 G B", "inf"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="bad size"):
        parse_size(text)


def test_size_flags(capsys: pytest.CaptureFixture[str]) -> None:
    parse = build_parser().parse_args
    assert parse(["serve", "--kv-cache-memory", "1GiB"]).kv_cache_memory == 1 << 30
    assert parse(["generate", "--prompt", "x", "--kv-cache-memory", "512MiB"]
                 ).kv_cache_memory == 512 << 20
    assert parse(["profile", "--kv-cache-memory", "2GB"]).kv_cache_memory == 2 * 10**9
    assert parse(["serve", "--kv-cache-memory", str(1 << 20)]).kv_cache_memory == 1 << 20
    # --swap-space keeps GiB floats; units convert
    assert parse(["serve", "--swap-space", "4"]).swap_space == 4.0
    assert parse(["serve", "--swap-space", "0.5"]).swap_space == 0.5
    assert parse(["serve", "--swap-space", "512MiB"]).swap_space == 0.5
    assert parse(["simulate", "--swap-space", "2GiB"]).swap_space == 2.0
    assert size_gib("0") == 0.0
    for argv, flag in ((["serve", "--kv-cache-memory", "1GX"], "--kv-cache-memory"),
                       (["serve", "--swap-space", "lots"], "--swap-space")):
        line = _fails(capsys, *argv).strip().splitlines()[0]
        assert line.startswith(f"kvloop serve: error: argument {flag}: bad size ")
        assert "512MiB" in line
    line = _fails(capsys, "serve", "--kv-cache-memory", "0").strip().splitlines()[0]
    assert "must be at least 1 byte" in line


def test_format_size() -> None:
    assert format_size(512) == "512 B"
    assert format_size(48 << 20) == "48.0 MiB"
    assert format_size(3 << 29) == "1.50 GiB"


# -- serve: the port before the model -------------------------------------------------------

def test_serve_refuses_a_taken_port_before_loading(capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path) -> None:
    pytest.importorskip("uvicorn")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # the model does not exist: the port error shows it was checked first
        rc = main(["serve", "--model", str(tmp_path / "missing"), "--port", str(port)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err == (f"kvloop: error: cannot serve on 127.0.0.1:{port}: the port is in use "
                   "(another server?); choose another --port\n")


def test_check_address() -> None:
    from kvloop.cli.serve import check_address

    port = check_address("127.0.0.1", 0)
    assert port > 0
    assert check_address("127.0.0.1", port) == port  # free again: the check let it go
    with pytest.raises(ValueError, match=r"cannot serve on --host 'no-such-host\.invalid'"):
        check_address("no-such-host.invalid", port)


# -- generate: --max-tokens against the model's length, before loading ---------------------

def _model_folder(root: Path, **config: object) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


def _generate_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["generate", "--prompt", "x", *argv])


def test_max_tokens_checked_against_a_local_folder(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "m", max_position_embeddings=128)
    check_max_tokens_early(_generate_args("--model", str(folder), "--max-tokens", "127"))
    check_max_tokens_early(_generate_args("--model", str(folder)))  # nothing to check
    with pytest.raises(ValueError) as exc:
        check_max_tokens_early(_generate_args("--model", str(folder), "--max-tokens", "128"))
    assert str(exc.value) == (
        "--max-tokens 128 leaves no room for a prompt: a prompt and its output fit in 128 "
        f"tokens (the model's max_position_embeddings in {folder / 'config.json'}); use "
        "--max-tokens 127 or less")
    with pytest.raises(ValueError, match=r"fit in 64 tokens \(--max-model-len\)"):
        check_max_tokens_early(_generate_args("--model", str(folder), "--max-model-len", "64",
                                              "--max-tokens", "64"))
    with pytest.raises(ValueError, match="--max-model-len 256 exceeds the model's"):
        check_max_tokens_early(_generate_args("--model", str(folder), "--max-model-len", "256"))


def test_max_tokens_unchecked_when_the_model_is_not_at_hand(tmp_path: Path) -> None:
    for model in (str(tmp_path / "missing"), str(tmp_path / "missing.gguf"),
                  str(_model_folder(tmp_path / "no-length"))):
        check_max_tokens_early(_generate_args("--model", model, "--max-tokens", "99999999"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    assert local_model_config(str(tmp_path / "bad")) is None


def test_max_tokens_checked_against_the_converted_default(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from kvloop.engine import model_source

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    converted = tmp_path / "converted"
    monkeypatch.setattr(model_source, "default_gguf_path", lambda: gguf)
    monkeypatch.setattr(model_source, "converted_path", lambda path: converted)
    args = _generate_args("--max-tokens", "8192")
    check_max_tokens_early(args)  # not converted yet: nothing to read
    _model_folder(converted, max_position_embeddings=8192)
    with pytest.raises(ValueError, match="--max-tokens 8192 leaves no room"):
        check_max_tokens_early(args)
    with pytest.raises(ValueError, match="--max-tokens 8192 leaves no room"):
        check_max_tokens_early(_generate_args("--model", str(gguf), "--max-tokens", "8192"))


def test_max_tokens_check_imports_no_torch(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "m", max_position_embeddings=16)
    code = (
        "import sys\n"
        "from kvloop.cli.main import build_parser\n"
        "from kvloop.cli.args import check_max_tokens_early\n"
        f"args = build_parser().parse_args(['generate', '--prompt', 'x', '--max-tokens', '8'])\n"
        "check_max_tokens_early(args)\n"
        f"args.model = {str(folder)!r}\n"
        "check_max_tokens_early(args)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _folder_with_tokenizer(root: Path, max_len: int) -> Path:
    """A model folder holding config.json and a word-level tokenizer (one token per word,
    a BOS first, a chat template), and no weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "hi", "user", "assistant", ":"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}{{ m.role }} : {{ m.content }} {% endfor %}"
                          "assistant :")
    fast.save_pretrained(root)
    return _model_folder(root, max_position_embeddings=max_len)


def test_prompts_checked_before_loading(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvloop.engine import llm

    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the prompt was checked")

    monkeypatch.setattr(llm, "LLM", no_loading)
    folder = str(_folder_with_tokenizer(tmp_path / "m", max_len=8))
    for argv, message in [
        (["--prompt", ""], "--prompt is empty: give the text to continue"),
        (["--prompt", "hi", "--prompt", "  "], "--prompt 2 is empty"),
        (["--prompt", "hi " * 8], "--prompt is 8 tokens; with one output token that is more "
         f"than the 8 tokens the model takes (the model's max_position_embeddings in {folder}"),
        (["--prompt", "hi " * 4, "--max-tokens", "5"], "--prompt is 4 tokens; with "
         "--max-tokens 5 that is more than the 8 tokens"),
        (["--prompt", "hi hi", "--max-model-len", "2"], "--prompt is 2 tokens; with one "
         "output token that is more than the 2 tokens the model takes (--max-model-len)"),
        # the chat template's words count: user : hi hi hi hi assistant : is 8
        (["--chat", "--prompt", "hi hi hi hi"], "--prompt is 8 tokens"),
    ]:
        assert main(["generate", "--model", folder, *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kvloop: error: {message}"), err
    with pytest.raises(AssertionError, match="was loaded"):  # fits: on to loading
        main(["generate", "--model", folder, "--chat", "--prompt", "hi hi hi"])


def _help_of(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text ``--help`` prints for ``action`` (as formatted, defaults expanded)."""
    formatter = parser._get_formatter()
    section = formatter._format_action(action)
    return " ".join(section.split())


def test_every_option_shows_its_default() -> None:
    checked = 0
    for prog, parser in _parsers(build_parser()):
        for action in parser._actions:
            switch = action.nargs == 0 and not isinstance(action,
                                                          argparse.BooleanOptionalAction)
            if switch or action.required or not action.option_strings:
                continue
            text = _help_of(parser, action)
            assert "default" in text, f"{prog} {action.option_strings[0]}: {text}"
            assert "None" not in text, f"{prog} {action.option_strings[0]}: {text}"
            checked += 1
    assert checked > 100


@pytest.mark.parametrize("argv, flag, shown", [
    (["generate"], "--seed", "default: 0"),
    (["generate"], "--dtype", "default: auto"),
    (["serve"], "--port", "default: 8000"),
    (["serve"], "--max-num-seqs", "default: 256"),
    (["serve"], "--max-num-batched-tokens", "default: auto: 2048 on CUDA; on CPU"),
    (["serve"], "--enable-prefix-caching", "default: True"),
    (["simulate"], "--prompt-len", "default: trace:sharegpt"),
    (["simulate"], "--max-num-batched-tokens", "default: 8192"),
    (["simulate"], "--tensor-parallel-size", "default: 1"),
    (["bench", "serve"], "--goodput", "milliseconds"),
    (["bench", "serve"], "--seed", "different seed"),
    (["serve"], "--slo-ttft", "seconds"),
    (["serve"], "--slo-tpot", "seconds"),
])
def test_help_shows(capsys: pytest.CaptureFixture[str], argv: list[str], flag: str,
                    shown: str) -> None:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    out = capsys.readouterr().out
    start = re.search(rf"^  {flag}[ ,\n]", out, re.MULTILINE)
    assert start is not None, out
    entry = " ".join(out[start.start():].split("\n  -")[0].split())
    assert shown in entry, entry
