"""The ``kvloop`` argument parser's behaviour and running one command with it: what every
subcommand shares (``kvloop.cli.main`` registers them; ``kvloop sweep`` runs ``simulate``
through the same).

Bad input (an unknown preset, a malformed trace, an impossible config) prints one line,
``kvloop: error: ...``, and exits with code 2; never a traceback. A flag argparse does not
know, or a value a flag refuses, prints the same one line (naming the closest flags it does
know, or the value and the choices) and a hint to the (sub)command's ``--help``, never the
usage block, and exits 2. Flags are never abbreviated.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

_PARSER_DEST = "_kvloop_parser"
"""Namespace attribute naming the innermost (sub)parser that parsed the command line."""


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` shows every option's default: ``(default: X)`` is added to an option whose
    help does not already say its default, help or not. Left alone: switches
    (``store_true``), required options, positionals, and options whose default is ``None``
    (their help says what happens without them; ``tests/test_cli_polish.py`` holds every
    option to that)."""

    @staticmethod
    def _adds_default(action: argparse.Action) -> bool:
        switch = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
        return not (switch or action.required or not action.option_strings
                    or action.default in (None, argparse.SUPPRESS)
                    or "default" in (action.help or "").lower())

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._adds_default(action):  # argparse skips an empty help
            action = copy.copy(action)
            action.help = "default: %(default)s"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if not self._adds_default(action) or action.help == "default: %(default)s":
            return action.help
        shown = "none" if action.default in ([], ()) else "%(default)s"
        return f"{action.help} (default: {shown})"


class KvloopParser(argparse.ArgumentParser):
    """``ArgumentParser`` without prefix matching, showing defaults in ``--help``
    (``DefaultsHelpFormatter``), whose unknown-flag error comes from the innermost
    subcommand's parser (its usage, not the top-level one).

    Subparsers are made of the parser's own class (``add_subparsers`` defaults
    ``parser_class`` to it), so every ``kvloop`` subcommand, nested ones too, gets both."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)
        # NOTE: a subparser's defaults overwrite its parent's in the namespace, so this ends
        # up naming the innermost parser that ran.
        self.set_defaults(**{_PARSER_DEST: self})

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        ns, extras = self.parse_known_args(args, namespace)
        parser = vars(ns).pop(_PARSER_DEST, self)
        if extras:
            parser.unknown(extras)
        return ns

    def error(self, message: str) -> NoReturn:
        """Exit 2 with one line naming the problem and one pointing at ``--help``; argparse's
        own ``error`` prints the whole usage block first, which buries the line that matters."""
        self.exit(2, f"{self.prog}: error: {message}\n"
                     f"(run '{self.prog} --help' for every flag and its choices)\n")

    def unknown(self, extras: list[str]) -> NoReturn:
        """Exit 2 on unrecognized arguments, naming the closest known flags."""
        known = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        hints: list[str] = []
        for arg in extras:
            flag = arg.split("=", 1)[0]
            if not flag.startswith("--") or len(flag) < 4:
                continue
            word = flag[2:]
            near = [k for k in known if k.startswith(flag)]  # what abbreviation would pick
            near += [k for k in known if word in k]
            if not near:  # a typo, then
                near = difflib.get_close_matches(flag, known, n=3, cutoff=0.75)
            for k in near:
                if k not in hints:
                    hints.append(k)
        hint = f" (did you mean {' or '.join(hints[:3])}?)" if hints else ""
        self.error(f"unrecognized arguments: {' '.join(extras)}{hint}")


def run_command(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` with ``parser`` and run the command it names; its exit code (2, with
    one ``kvloop: error:`` line, for bad input)."""
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"kvloop: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
