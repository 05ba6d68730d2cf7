"""Write the generated reference pages:

- ``docs/reference/cli.md`` and ``docs/reference/cli/COMMAND.md`` from the ``kvloop``
  argument parsers: the commands, then one page per command with its subcommands, each
  ``--help`` the same on every machine (a fixed width of 100 columns; a CPU count in a
  help text is shown as ``N``);
- ``docs/reference/config.md`` from the configuration dataclasses (``EngineArgs``,
  ``SchedulerConfig``, ``CacheConfig``): every field with its type, default and docstring,
  read from the source;
- ``docs/reference/metrics.md`` from the server's Prometheus registry: every metric's name,
  type, labels and help text.

    python scripts/gen_reference.py           # rewrite the pages
    python scripts/gen_reference.py --check   # exit 1 when a page is out of date

``tests/docs/test_cli_reference.py`` runs the check, so a flag, a config field or a metric added
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
CLI_DIR = ROOT / "docs" / "reference" / "cli"
CONFIG_PAGE = ROOT / "docs" / "reference" / "config.md"
METRICS_PAGE = ROOT / "docs" / "reference" / "metrics.md"
CONFIG_SOURCES = [  # (module, dataclass), in the order the page shows them
    ("kvloop.engine.args", "EngineArgs"),
    ("kvloop.config", "SchedulerConfig"),
    ("kvloop.config", "CacheConfig"),
]
WIDTH = "100"
_CPU_MARK = 987654  # stands for this machine's CPU count while the parsers are built

HEADER = """\
# Command line

Every `kvloop` command and its flags, as `--help` prints them, one page per command. These
pages are generated from the argument parsers by `python scripts/gen_reference.py`; do not
edit them by hand.

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


def _help_block(prog: str, text: str) -> list[str]:
    return [f"## {prog}", "", "```text", text.replace(str(_CPU_MARK), "N").rstrip(), "```", ""]


def render_cli() -> dict[Path, str]:
    """The command-line pages: the index (``kvloop --help`` and the commands) and one page
    per command, its subcommands after it."""
    with mock.patch.dict(os.environ, {"COLUMNS": WIDTH, "LINES": "50"}), \
            mock.patch("os.cpu_count", return_value=_CPU_MARK):
        from kvloop.cli.main import build_parser

        parsers = list(_subcommands(build_parser()))
        helps = [(p.prog, p.format_help()) for p in parsers]
    root, *commands = helps
    by_command: dict[str, list[tuple[str, str]]] = {}
    for prog, text in commands:
        by_command.setdefault(prog.split()[1], []).append((prog, text))
    toc = [f"- [`kvloop {name}`](cli/{name}.md)" + (
        " (" + ", ".join(f"`{p}`" for p, _ in progs[1:]) + ")" if len(progs) > 1 else "")
        for name, progs in by_command.items()]
    out = {PAGE: "\n".join([HEADER, "\n".join(toc), "", *_help_block(*root)])}
    for name, progs in by_command.items():
        parts = [f"# kvloop {name}", "",
                 "Generated from the argument parsers by `python scripts/gen_reference.py`; "
                 "the other commands: [command line](../cli.md).", ""]
        for prog, text in progs:
            parts += _help_block(prog, text)
        out[CLI_DIR / f"{name}.md"] = "\n".join(parts)
    return out


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


METRICS_HEADER = """\
# Prometheus metrics

`kvloop serve` exposes these at `GET /metrics` (Prometheus text format). The names are
vLLM's with a `kvloop:` prefix, so dashboards written for vLLM need only the prefix
changed. Every series has a `model_name` label (the served model name); with
`--replicas N` every series also has a `replica` label. Times are seconds; the metrics mean
what the [definitions](#definitions) below say. Counters are exported with a `_total`
suffix (`kvloop:num_preemptions_total`), histograms as `_bucket`, `_sum` and `_count`
series. This page is generated from the server's registry by
`python scripts/gen_reference.py`; do not edit it by hand.

The prefix-cache hit rate over five minutes is
`rate(kvloop:prefix_cache_hits_total[5m]) / rate(kvloop:prefix_cache_queries_total[5m])`.
"""

METRICS_FOOTER = """\
## Definitions

The same meaning everywhere: engine, simulator, server and benchmarks.

- **TTFT**: arrival to first output token (queueing and the whole prefill included).
- **TPOT**: per request, (e2e − TTFT) / (output tokens − 1); requests with one output token
  have none. Aggregates are over requests.
- **ITL**: each gap between consecutive output tokens of a request; aggregates are over all
  gaps of all requests.
- **e2e latency**: arrival to last token. **Queue time**: arrival to first scheduled.
- **Throughput**: output tokens (and, separately, total tokens) per second of wall time
  (virtual time in the simulator) from the first arrival to the last completion.
- **Goodput**: completed requests per second that met every given SLO (TTFT and/or TPOT).
- **Prefix-cache hit rate**: prompt tokens served from cached blocks / prompt tokens looked
  up (first admission only; recomputation after preemption is counted apart).
- Percentiles are nearest-rank over the finished requests (aborted and failed requests are
  excluded and counted apart).
"""


def render_metrics() -> str:
    from kvloop.server.metrics import ServerMetrics

    registry = ServerMetrics("MODEL").registry
    label_names = {getattr(c, "_name", ""): tuple(getattr(c, "_labelnames", ()))
                   for c in registry._collector_to_names}
    groups: dict[str, list[str]] = {"gauge": [], "counter": [], "histogram": []}
    for fam in registry.collect():
        labels = label_names.get(fam.name, ())
        row = (f"| `{fam.name}` | {', '.join(f'`{k}`' for k in labels)} "
               f"| {_cell(fam.documentation)} |")
        groups.setdefault(fam.type, []).append(row)
    titles = {"gauge": "State (gauges)", "counter": "Work done (counters)",
              "histogram": "Latencies and sizes (histograms)"}
    parts = [METRICS_HEADER]
    for kind, rows in groups.items():
        if rows:
            parts += [f"## {titles.get(kind, kind)}", "", "| metric | labels | meaning |",
                      "|---|---|---|", *rows, ""]
    parts.append(METRICS_FOOTER)
    return "\n".join(parts)


def pages() -> dict[Path, str]:
    """Each generated page and its text."""
    return {**render_cli(), CONFIG_PAGE: render_config(), METRICS_PAGE: render_metrics()}


def stray_pages() -> list[Path]:
    """Pages in the generated command folder that no command writes any more."""
    made = set(render_cli())
    return sorted(p for p in CLI_DIR.glob("*.md") if p not in made) if CLI_DIR.is_dir() else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when a checked-in page differs from what the code says")
    args = ap.parse_args()
    stale = 0
    for page in stray_pages():
        if args.check:
            print(f"{page.relative_to(ROOT)} is no command's page: delete it", file=sys.stderr)
            stale += 1
        else:
            page.unlink()
            print(f"removed {page.relative_to(ROOT)}")
    for page, text in pages().items():
        name = page.relative_to(ROOT)
        if args.check:
            if not page.is_file() or page.read_text() != text:
                print(f"{name} is out of date: run python scripts/gen_reference.py",
                      file=sys.stderr)
                stale += 1
        else:
            page.parent.mkdir(parents=True, exist_ok=True)
            page.write_text(text)
            print(f"wrote {name}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
