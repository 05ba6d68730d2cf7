"""``kvloop`` command line: one subcommand per module of ``kvloop.cli``, registered in
``COMMANDS``.

Bad input (an unknown preset, a malformed trace, an impossible config) prints one line,
``kvloop: error: ...``, and exits with code 2; never a traceback. A flag argparse does not
know prints the usage of the (sub)command it was given to, then one error line (with the
closest flags it does know), and exits 2. Flags are never abbreviated: ``--rate`` is an
error, not ``--rate-scale``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
from collections.abc import Callable, Sequence

from kvloop.cli.bench import register as register_bench
from kvloop.cli.generate import register as register_generate
from kvloop.cli.parser import KvloopParser, run_command
from kvloop.cli.profile import register as register_profile
from kvloop.cli.serve import register as register_serve
from kvloop.cli.simulate import register as register_simulate
from kvloop.cli.sweep import register as register_sweep
from kvloop.cli.trace import register as register_trace

Register = Callable[[argparse._SubParsersAction], None]
COMMANDS: list[Register] = [
    register_bench,
    register_generate,
    register_profile,
    register_serve,
    register_simulate,
    register_sweep,
    register_trace,
]

def version() -> str:
    """The installed distribution's version (the package's own when not installed)."""
    try:
        return importlib.metadata.version("kvloop")
    except importlib.metadata.PackageNotFoundError:
        import kvloop

        return kvloop.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = KvloopParser(
        prog="kvloop", description="An LLM serving engine built around an inspectable loop."
    )
    parser.add_argument("--version", action="version", version=f"kvloop {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in COMMANDS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(build_parser(), argv)
