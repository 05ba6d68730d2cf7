"""``kvloop`` command line: one subcommand per module, registered in ``COMMANDS``.

Bad input (an unknown preset, a malformed trace, an impossible config) prints one line,
``kvloop: error: ...``, and exits with code 2; never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from kvloop.bench import command as bench_command
from kvloop.engine import command as generate_command
from kvloop.server import command as serve_command
from kvloop.sim import command as simulate_command
from kvloop.sim import profile_command
from kvloop.viz import command as trace_command

Register = Callable[[argparse._SubParsersAction], None]
COMMANDS: list[Register] = [
    bench_command.register,
    generate_command.register,
    profile_command.register,
    serve_command.register,
    simulate_command.register,
    trace_command.register,
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


if __name__ == "__main__":
    raise SystemExit(main())
