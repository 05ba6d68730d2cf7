"""``kvloop`` command line: one subcommand per module of ``kvloop.cli``, registered in
``COMMANDS``.

Bad input (an unknown preset, a malformed trace, an impossible config) prints one line,
``kvloop: error: ...``, and exits with code 2; never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from kvloop.cli.bench import register as register_bench
from kvloop.cli.generate import register as register_generate
from kvloop.cli.profile import register as register_profile
from kvloop.cli.serve import register as register_serve
from kvloop.cli.simulate import register as register_simulate
from kvloop.cli.trace import register as register_trace

Register = Callable[[argparse._SubParsersAction], None]
COMMANDS: list[Register] = [
    register_bench,
    register_generate,
    register_profile,
    register_serve,
    register_simulate,
    register_trace,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvloop", description="An LLM serving engine built around an inspectable loop."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in COMMANDS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"kvloop: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
