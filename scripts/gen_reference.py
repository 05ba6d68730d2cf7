"""Write the generated reference pages:

- ``docs/reference/cli.md`` from the ``kvloop`` argument parsers: every command's
  ``--help``, the same on every machine (a fixed width of 100 columns; a CPU count in a
  help text is shown as ``N``);
- ``docs/reference/config.md`` from the configuration dataclasses (``EngineArgs``,
  ``SchedulerConfig``, ``CacheConfig``): every field with its type, default and docstring,
  read from the source.

    python scripts/gen_reference.py           # rewrite the pages
    python scripts/gen_reference.py --check   # exit 1 when a page is out of date

``tests/docs/test_cli_reference.py`` runs the check, so a flag or a config field added
without rerunning this script fails the tests.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "cli.md"
CONFIG_PAGE = ROOT / "docs" / "reference" / "config.md"
CONFIG_SOURCES = [  # (module, dataclass), in the order the page shows them
    ("kvloop.engine.args", "EngineArgs"),
    ("kvloop.config", "SchedulerConfig"),
    ("kvloop.config", "CacheConfig"),
]
WIDTH = "100"
_CPU_MARK = 987654  # stands for this machine's CPU count while the parsers are built

HEADER = """\
# Command line

Every `kvloop` command and its flags, as `--help` prints them. This page is generated from
the argument parsers by `python scripts/gen_reference.py`; do not edit it by hand.

Flags named like vLLM's mean what they mean in vLLM. Bad input prints one line,
`kvloop: error: ...`, and exits with code 2. Flags are never abbreviated.
"""


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and every (nested) subcommand's parser, depth first, in registration order."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for sub in action.choices.values():
                if id(sub) not in seen:  # aliases share one parser
                    seen.add(id(sub))
                    yield from _subcommands(sub)


def render() -> str:
    """The page's text."""
    with mock.patch.dict(os.environ, {"COLUMNS": WIDTH, "LINES": "50"}), \
            mock.patch("os.cpu_count", return_value=_CPU_MARK):
        from kvloop.cli.main import build_parser

        parsers = list(_subcommands(build_parser()))
        helps = [(p.prog, p.format_help()) for p in parsers]
    toc = [f"- [`{prog}`](#{prog.replace(' ', '-')})" for prog, _ in helps]
    parts = [HEADER, "\n".join(toc), ""]
    for prog, text in helps:
        text = text.replace(str(_CPU_MARK), "N").rstrip()
        parts += [f"## {prog}", "", "```text", text, "```", ""]
    return "\n".join(parts)


CONFIG_HEADER = """\
# Configuration fields

Every field of kvloop's configuration dataclasses, with its type, default and meaning. This
page is generated from the source by `python scripts/gen_reference.py`; do not edit it by
hand.

- `EngineArgs` is what `LLM(...)` takes as keywords and what `kvloop generate` and
  `kvloop serve` take as flags (`max_num_seqs` is `--max-num-seqs`); the engine derives
  the scheduler's and the KV cache's configuration from it.
- `SchedulerConfig` and `CacheConfig` are the frozen configurations the scheduler and the
  KV cache manager receive (also in the simulator, where `kvloop simulate` builds them from
  its flags).
"""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _fields(module: str, cls: str) -> tuple[str, list[tuple[str, str, str, str]]]:
    """(class docstring, [(field, type, default, docstring)]) of a dataclass, read from the
    source of the module that imports (the field docstrings exist only there)."""
    spec = importlib.util.find_spec(module)
    tree = ast.parse(Path(spec.origin).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    doc = ast.get_docstring(node) or ""
    rows: list[tuple[str, str, str, str]] = []
    body = node.body
    for i, item in enumerate(body):
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
            continue
        if item.target.id.startswith("_"):
            continue
        nxt = body[i + 1] if i + 1 < len(body) else None
        text = (nxt.value.value if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str) else "")
        default = ast.unparse(item.value) if item.value is not None else "(required)"
        rows.append((item.target.id, ast.unparse(item.annotation), default, text))
    return doc, rows


def render_config() -> str:
    parts = [CONFIG_HEADER]
    for source, cls in CONFIG_SOURCES:
        doc, rows = _fields(source, cls)
        parts += [f"## {cls}", "", f"`{source}.{cls}`: {_cell(doc)}", "",
                  "| field | type | default | meaning |", "|---|---|---|---|"]
        parts += [f"| `{name}` | `{_cell(typ)}` | `{_cell(default)}` | {_cell(text)} |"
                  for name, typ, default, text in rows]
        parts.append("")
    return "\n".join(parts)


def pages() -> dict[Path, str]:
    """Each generated page and its text."""
    return {PAGE: render(), CONFIG_PAGE: render_config()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when a checked-in page differs from what the code says")
    args = ap.parse_args()
    stale = 0
    for page, text in pages().items():
        name = page.relative_to(ROOT)
        if args.check:
            if not page.is_file() or page.read_text() != text:
                print(f"{name} is out of date: run python scripts/gen_reference.py",
                      file=sys.stderr)
                stale += 1
        else:
            page.write_text(text)
            print(f"wrote {name}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
