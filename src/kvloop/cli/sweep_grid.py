"""The grid of ``kvloop sweep``: ``--grid NAME=V1,V2,...`` axes and the fixed ``simulate``
arguments, expanded into configurations and checked by the real ``simulate`` parser before
anything runs (``build_sweep``)."""

from __future__ import annotations

import argparse
import difflib
import itertools
import math
from dataclasses import dataclass

from kvloop.cli.parser import KvloopParser
from kvloop.cli.simulate import check_cluster_args
from kvloop.cli.simulate import register as register_simulate

MAX_CONFIGS = 1000
"""Most configurations one sweep runs."""
_OWN_FLAGS = ("--json", "--trace-out")
"""Simulate flags the sweep cannot pass on: every task would write the same file."""
_SWEEP_FLAGS = ("--grid", "--out", "--ray-address", "--workers")
"""The sweep's own flags: refused after ``--``, where simulate's go."""


@dataclass(frozen=True)
class Config:
    """One configuration: its grid values, its simulate argv and its cost in GPUs."""

    index: int
    values: dict[str, str]
    argv: list[str]
    gpus: int


@dataclass(frozen=True)
class Sweep:
    """A checked sweep: the shared simulate args, the grid's axes and every configuration."""

    fixed: list[str]
    grid: dict[str, list[str]]
    configs: list[Config]


class _Refused(Exception):
    """What the checking parser says instead of printing usage and exiting."""


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """A ``kvloop`` parser with only ``simulate``, built as ``kvloop.cli.main`` builds it but
    raising ``_Refused`` where it would print usage and exit; and its ``simulate`` parser."""
    class Checking(KvloopParser):
        def error(self, message: str):  # type: ignore[override]
            raise _Refused(message)

        def exit(self, status: int = 0, message: str | None = None):  # type: ignore[override]
            raise _Refused(message or "a configuration asks for --help")

    parser = Checking(prog="kvloop")
    sub = parser.add_subparsers(dest="command", required=True)
    register_simulate(sub)
    return parser, sub.choices["simulate"]


def _lookup(simulate: argparse.ArgumentParser, name: str) -> argparse.Action | None:
    """The simulate option ``--NAME`` (or ``-NAME``: ``tp``)."""
    actions = simulate._option_string_actions
    return actions.get(f"--{name}") or actions.get(f"-{name}")


def _axis(simulate: argparse.ArgumentParser, spec: str) -> tuple[str, list[str], list[list[str]]]:
    """``NAME=V1,V2`` -> (NAME, values, the simulate argv tokens of each value)."""
    name, sep, text = spec.partition("=")
    name = name.strip().lstrip("-")
    values = [v.strip() for v in text.split("|" if "|" in text else ",")]
    if not sep or not name or not all(values):
        raise ValueError(f"--grid {spec!r}: expected NAME=V1,V2,... with no empty value")
    action = _lookup(simulate, name)
    if action is None:
        known = [s for s in simulate._option_string_actions if s.startswith("--")]
        near = ([k for k in known if name in k]
                or difflib.get_close_matches(f"--{name}", known, n=3, cutoff=0.7))
        hint = f" (did you mean {' or '.join(near[:3])}?)" if near else ""
        raise ValueError(f"--grid {name}: kvloop simulate has no flag --{name}{hint}")
    if action.dest == "help" or set(action.option_strings) & set(_OWN_FLAGS):
        raise ValueError(f"--grid {name}: not a flag to sweep (the sweep writes its own "
                         "outputs: --out)")
    if action.nargs == 0:  # a switch: true gives it, false leaves it out (or gives --no-X)
        flip = isinstance(action, argparse.BooleanOptionalAction) and name.startswith("no-")
        tokens = []
        for v in values:
            if v.lower() not in ("true", "false"):
                raise ValueError(f"--grid {name}: a switch takes true,false, not {v!r}")
            on = (v.lower() == "true") != flip
            if isinstance(action, argparse.BooleanOptionalAction):
                tokens.append([action.option_strings[0 if on else 1]])  # --X, --no-X
            else:
                tokens.append([action.option_strings[0]] if on else [])
        return name, values, tokens
    if action.nargs not in (None, "?"):
        raise ValueError(f"--grid {name}: takes several values; it cannot be swept")
    flag = next(s for s in action.option_strings if s.startswith("--"))
    # NOTE: FLAG=VALUE keeps a value that starts with '-' a value
    return name, values, [[f"{flag}={v}"] for v in values]


def _check_fixed(simulate: argparse.ArgumentParser, fixed: list[str],
                 swept: dict[str, str]) -> None:
    """Refuse a fixed flag that is also swept (``swept``: dest -> axis) or is the sweep's."""
    for token in fixed:
        flag = token.split("=", 1)[0]
        action = simulate._option_string_actions.get(flag) if flag.startswith("-") else None
        if action is not None and action.dest in swept:
            raise ValueError(f"{flag} is both after -- and in --grid {swept[action.dest]}: "
                             "give it once")
        if action is not None and set(action.option_strings) & set(_OWN_FLAGS):
            raise ValueError(f"{flag} after --: the sweep writes its own outputs (--out)")


def build_sweep(grid: list[str], fixed: list[str]) -> Sweep:
    """Every configuration of the grid, each checked by simulate's parser; ``ValueError``
    (one line naming the axis or the configuration) on anything wrong."""
    fixed = fixed[1:] if fixed[:1] == ["--"] else list(fixed)
    for token in fixed:
        if token.split("=", 1)[0] in _SWEEP_FLAGS:
            raise ValueError(f"{token.split('=', 1)[0]} is the sweep's own flag: give it "
                             "before --, the simulate flags after")
    if not grid:
        raise ValueError("give at least one --grid NAME=V1,V2,... (a simulate flag to vary)")
    top, simulate = _parsers()
    axes = [_axis(simulate, spec) for spec in grid]
    swept: dict[str, str] = {}
    for name, _, _ in axes:
        dest = _lookup(simulate, name).dest  # type: ignore[union-attr]
        if dest in swept:
            raise ValueError(f"--grid {name}: the same flag as --grid {swept[dest]}")
        swept[dest] = name
    _check_fixed(simulate, fixed, swept)
    total = math.prod(len(values) for _, values, _ in axes)
    if total > MAX_CONFIGS:
        raise ValueError(f"the grid has {total} configurations; at most {MAX_CONFIGS} "
                         "(split the sweep)")
    configs = []
    for index, combo in enumerate(itertools.product(*(range(len(v)) for _, v, _ in axes))):
        picked = list(zip(axes, combo, strict=True))
        values = {name: vals[k] for (name, vals, _), k in picked}
        argv = [*fixed, *(t for (_, _, tokens), k in picked for t in tokens[k])]
        try:
            ns = top.parse_args(["simulate", *argv])
            check_cluster_args(ns)
        except (_Refused, ValueError) as exc:
            what = " ".join(f"{n}={v}" for n, v in values.items())
            raise ValueError(f"configuration {index + 1} of {total} ({what}): "
                             f"{str(exc).strip()}") from None
        # NOTE: --replicas is simulate's (when it has it); cost = replicas x TP GPUs
        gpus = (getattr(ns, "replicas", None) or 1) * ns.tensor_parallel_size
        configs.append(Config(index, values, argv, gpus))
    return Sweep(fixed, {name: values for name, values, _ in axes}, configs)
