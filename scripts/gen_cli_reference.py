"""Write docs/reference/cli.md from the ``kvloop`` argument parsers: every command's
``--help``, the same on every machine (a fixed width of 100 columns; a CPU count in a
help text is shown as ``N``).

    python scripts/gen_cli_reference.py           # rewrite the page
    python scripts/gen_cli_reference.py --check   # exit 1 when the page is out of date

``tests/docs/test_cli_reference.py`` runs the check, so a flag added without rerunning this
script fails the tests.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "cli.md"
WIDTH = "100"
_CPU_MARK = 987654  # stands for this machine's CPU count while the parsers are built

HEADER = """\
# Command line

Every `kvloop` command and its flags, as `--help` prints them. This page is generated from
the argument parsers by `python scripts/gen_cli_reference.py`; do not edit it by hand.

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when the checked-in page differs from the parsers")
    args = ap.parse_args()
    text = render()
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run python "
                  "scripts/gen_cli_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
