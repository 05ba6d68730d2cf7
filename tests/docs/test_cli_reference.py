"""The generated reference pages (the command line, the configuration fields) are what the
code says, and every ``kvloop ...`` command the README and the docs show uses flags the CLI
accepts."""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = {ROOT / "docs" / "reference" / "cli.md",
             *(ROOT / "docs" / "reference" / "cli").glob("*.md")}


def _generator():
    spec = importlib.util.spec_from_file_location(
        "gen_reference", ROOT / "scripts" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_pages_are_current() -> None:
    generator = _generator()
    for page, text in generator.pages().items():
        assert page.is_file() and page.read_text() == text, (
            f"{page.relative_to(ROOT)} is out of date: run python scripts/gen_reference.py")
    assert not generator.stray_pages(), "a command page no command writes: run the script"


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """prog ('kvloop trace plot') -> parser, for every command and subcommand."""
    return {p.prog: p for p in _generator()._subcommands(_build())}


def _build() -> argparse.ArgumentParser:
    from kvloop.cli.main import build_parser

    return build_parser()


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


_SEPARATORS = {"&&", "||", "|", ";", "&"}
_CODE_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_INLINE = re.compile(r"`(kvloop [^`]+)`")


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _commands(text: str) -> list[str]:
    """Every ``kvloop ...`` command line of a page: in shell blocks (continuations joined)
    and in inline code."""
    found: list[str] = []
    for lang, body in _CODE_BLOCK.findall(text):
        if lang not in ("bash", "sh", "shell", "console", ""):
            continue
        body = body.replace("\\\n", " ")
        for line in body.splitlines():
            line = line.strip().removeprefix("$ ")
            if "kvloop " in line and not line.startswith(("#", "kvloop:")):  # not output
                found.append(line)
    found += _INLINE.findall(text)
    return found


def _check(line: str, parsers: dict[str, argparse.ArgumentParser]) -> list[str]:
    """The flags of ``line``'s kvloop commands that their parser does not accept."""
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        return []
    bad: list[str] = []
    i = 0
    while i < len(tokens):
        if tokens[i] != "kvloop":
            i += 1
            continue
        prog, i = "kvloop", i + 1
        while i < len(tokens) and f"{prog} {tokens[i]}" in parsers:
            prog, i = f"{prog} {tokens[i]}", i + 1
        options = _options(parsers[prog])
        while i < len(tokens) and tokens[i] not in _SEPARATORS:
            tok = tokens[i]
            if tok == "--" and prog == "kvloop sweep":  # the rest is simulate's
                options = _options(parsers["kvloop simulate"])
            elif tok.startswith("-") and tok != "-" and not re.fullmatch(r"-?[\d.]+", tok):
                flag = tok.split("=", 1)[0]
                if flag not in options and not flag.startswith("-..."):
                    bad.append(f"{prog} {flag}")
            i += 1
    return bad


def test_documented_flags_exist() -> None:
    parsers = _parsers()
    problems: list[str] = []
    checked = 0
    for path in _doc_files():
        if path in GENERATED:
            continue
        for line in _commands(path.read_text()):
            checked += 1
            problems += [f"{path.relative_to(ROOT)}: {b}   ({line[:80]})"
                         for b in _check(line, parsers)]
    assert checked > 20
    assert not problems, "flags the CLI does not accept:\n" + "\n".join(problems)
