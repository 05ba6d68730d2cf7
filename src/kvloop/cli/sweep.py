"""``kvloop sweep``: run a grid of ``kvloop simulate`` configurations as Ray tasks.

Each ``--grid NAME=V1,V2,...`` names a ``simulate`` flag (without ``--``) and its values; the
cartesian product of the grids, each appended to the fixed ``simulate`` arguments given after
``--``, is one configuration. Every configuration is parsed by the real ``simulate`` parser
before Ray starts (``sweep_grid``). A task runs ``kvloop simulate ... --json FILE`` in-process
and sends the JSON back, so the sweep depends only on simulate's flags and JSON keys, never
its internals. Rows go to CSV and JSON, the Pareto picture to ``viz.pareto``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import shlex
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvloop.cli import simulate
from kvloop.cli.parser import KvloopParser, run_command
from kvloop.cli.sweep_grid import MAX_CONFIGS, Config, Sweep, build_sweep
from kvloop.viz.pareto import mark_pareto

METRICS = {  # column -> path into simulate's --json
    "completed": ("completed",),
    "failed": ("failed",),
    "output_tok_s": ("output_throughput",),
    "request_req_s": ("request_throughput",),
    "goodput_req_s": ("goodput",),
    "ttft_p50_s": ("ttft", "p50"),
    "ttft_p99_s": ("ttft", "p99"),
    "tpot_p50_s": ("tpot", "p50"),
    "prefix_hit_rate": ("scheduler", "prefix_cache_hit_rate"),
    "preemptions": ("preemptions",),
    "slo_ttft_s": ("slo_ttft",),
    "slo_tpot_s": ("slo_tpot",),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sweep",
        help="run a grid of simulate configurations on Ray; table and Pareto plot",
        description="Run the cartesian product of --grid values as `kvloop simulate` runs, "
        "one Ray task each (on --ray-address, else a local Ray with --workers processes), "
        "and write PREFIX.csv, PREFIX.json (one row per configuration) and PREFIX.png "
        "(Pareto fronts: output throughput vs p99 TTFT, goodput vs GPUs = replicas x "
        "tensor-parallel size). Exit code 1 when some configuration failed (its row says "
        "why in the error column), 2 on bad input.",
        epilog="example (docs/sweep.md): kvloop sweep --grid replicas=1,2,4,8 --grid "
        "router=round-robin,least-loaded,kv-aware --out sweep/mooncake -- --trace mooncake "
        "--num-requests 1000 --slo-ttft 2",
    )
    p.add_argument("--grid", action="append", default=[], metavar="NAME=V1,V2,...",
                   help="a simulate flag without -- and its values, comma-separated ('|' "
                   "instead when a value holds commas; true,false for a switch); repeat for "
                   f"more axes, at most {MAX_CONFIGS} configurations in all (default: none)")
    p.add_argument("simulate_args", nargs="*", metavar="-- SIMULATE_ARGS",
                   help="kvloop simulate flags every configuration shares, after --")
    p.add_argument("--out", default="sweep", metavar="PREFIX",
                   help="write PREFIX.csv, PREFIX.json and PREFIX.png (default: %(default)s)")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="run on this Ray cluster, e.g. HOST:6379, or auto for the one `ray "
                   "start` made here; its nodes need kvloop installed (default: none: start "
                   "a local Ray for the sweep)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="CPUs (parallel tasks) of the local Ray (default: all, "
                   f"{os.cpu_count()} here)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar while the tasks run")
    p.set_defaults(func=run)


def run_config(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The body of one Ray task: ``kvloop simulate ARGV --json FILE --no-progress``
    in-process, its output swallowed; the JSON it wrote and its warning lines.
    ``RuntimeError`` with simulate's error line when it fails."""
    parser = KvloopParser(prog="kvloop")
    simulate.register(parser.add_subparsers(dest="command", required=True))
    out, err = io.StringIO(), io.StringIO()
    with tempfile.TemporaryDirectory(prefix="kvloop-sweep-") as tmp:
        path = os.path.join(tmp, "metrics.json")
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = run_command(parser, ["simulate", *argv, "--json", path,
                                          "--no-progress"])
            except SystemExit as exc:  # argparse; the driver checked, so unlikely
                rc = exc.code if isinstance(exc.code, int) else 2
        lines = err.getvalue().strip().splitlines()
        if rc != 0:
            last = lines[-1].removeprefix("kvloop: error: ") if lines else ""
            raise RuntimeError(last or f"kvloop simulate exited with {rc}")
        with open(path) as f:
            metrics = json.load(f)
    return metrics, [line for line in lines if "warning:" in line]


def _get(metrics: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = metrics
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _flatten(prefix: str, value: Any, into: dict[str, Any]) -> None:
    """The scalars of a nested dict as ``prefix.key.subkey`` columns (lists left out)."""
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}", v, into)
    elif value is None or isinstance(value, int | float | str | bool):
        into[prefix] = value


def make_row(config: Config, metrics: dict[str, Any] | None, warnings: list[str],
             error: str = "") -> dict[str, Any]:
    """One table row: the grid values, the cost, the metrics, the cluster's when present."""
    row: dict[str, Any] = dict(config.values) | {"gpus": config.gpus}
    for column, path in METRICS.items():
        row[column] = _get(metrics, path) if metrics else None
    if metrics and isinstance(metrics.get("cluster"), dict):
        _flatten("cluster", metrics["cluster"], row)
    return row | {"error": error, "warnings": " | ".join(warnings),
                  "args": shlex.join(config.argv)}


def _error_text(exc: BaseException) -> str:
    """One line for a failed task: the exception inside Ray's wrapper, not its traceback."""
    cause = getattr(exc, "cause", None) or exc  # NOTE: RayTaskError wraps the task's own
    lines = str(cause).strip().splitlines()
    line = lines[0] if lines else ""
    # run_config's RuntimeError already is simulate's own error line
    return (line if type(cause) is RuntimeError else f"{type(cause).__name__}: {line}")[:300]


def run_on_ray(configs: list[Config], progress: bool) -> list[dict[str, Any]]:
    """Run every configuration as a task on the connected Ray; rows in grid order, each
    finished task ticking the progress bar as it lands (``ray.wait``)."""
    import ray
    from tqdm import tqdm

    task = ray.remote(num_cpus=1, max_retries=0)(run_config)
    pending = {task.remote(c.argv): c for c in configs}
    rows: dict[int, dict[str, Any]] = {}
    failed = 0
    try:
        with tqdm(total=len(configs), desc="sweep", unit="config", file=sys.stderr,
                  disable=not progress) as bar:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    config = pending.pop(ref)
                    try:
                        metrics, warnings = ray.get(ref)
                        rows[config.index] = make_row(config, metrics, warnings)
                    except Exception as exc:  # NOTE: one failed configuration, not the sweep
                        failed += 1
                        rows[config.index] = make_row(config, None, [], _error_text(exc))
                bar.update(len(done))
                if failed:
                    bar.set_postfix(failed=failed)
    finally:
        for ref in pending:  # interrupted: leave nothing running on a shared cluster
            ray.cancel(ref)
    return [rows[c.index] for c in configs]


def write_table(sweep: Sweep, rows: list[dict[str, Any]], prefix: Path) -> list[str]:
    """Write PREFIX.csv and PREFIX.json (the rows, with the sweep's grid and fixed args);
    the columns, in order."""
    tail = ["pareto_ttft", "pareto_cost", "error", "warnings", "args"]
    columns = [c for c in dict.fromkeys(k for row in rows for k in row) if c not in tail]
    columns += tail
    with open(f"{prefix}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns, restval="")
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)
    with open(f"{prefix}.json", "w") as f:
        json.dump({"simulate_args": sweep.fixed, "grid": sweep.grid, "columns": columns,
                   "rows": rows}, f, indent=2)
    return columns


def _plot(sweep: Sweep, rows: list[dict[str, Any]], path: str) -> bool:
    """The Pareto PNG, points labelled by the axes that vary; False when nothing succeeded."""
    from kvloop.viz.pareto import plot_sweep  # NOTE: matplotlib only when used

    varied = [name for name, values in sweep.grid.items() if len(values) > 1]
    labels = [" ".join(f"{n}={c.values[n]}" for n in varied) for c in sweep.configs]
    title = f"kvloop sweep -- {' '.join(sweep.fixed)}".rstrip(" -")
    return plot_sweep(rows, labels, path, title)


def _cell(value: Any, scale: float = 1.0, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "*" if value else ""
    return f"{value * scale:.{digits}f}" if isinstance(value, float) else str(value)


_CLUSTER_HEADS: dict[str, str | None] = {  # cluster.* column -> console heading
    "cluster.num_replicas": "replicas",  # shown once: the grid's when it sweeps replicas
    "cluster.prefix_cache_hit_rate": None,  # never: the same number as "prefix hit %"
}
"""Console headings of the ``cluster.*`` columns that would repeat another column; other
numeric ``cluster.*`` columns are headed by their name without ``cluster.``."""


def _columns(sweep: Sweep, rows: list[dict[str, Any]]) -> list[tuple[str, str, float, int]]:
    """The console table's columns (heading, row key, scale, digits), each quantity once:
    the grid's values, the main metrics, the cluster's numbers not shown already, Pareto."""
    shown = [(name, name, 1.0, 0) for name in sweep.grid] + [
        ("GPUs", "gpus", 1.0, 0), ("out tok/s", "output_tok_s", 1.0, 1),
        ("TTFT p50 s", "ttft_p50_s", 1.0, 3), ("TTFT p99 s", "ttft_p99_s", 1.0, 3),
        ("TPOT p50 ms", "tpot_p50_s", 1e3, 2), ("goodput/s", "goodput_req_s", 1.0, 3),
        ("prefix hit %", "prefix_hit_rate", 100.0, 1), ("preempt", "preemptions", 1.0, 0),
    ]
    cluster = dict.fromkeys(k for row in rows for k, v in row.items()
                            if k.startswith("cluster.") and isinstance(v, int | float))
    for key in cluster:
        head = _CLUSTER_HEADS.get(key, key.removeprefix("cluster."))
        if head is not None and head not in (h for h, *_ in shown):
            shown.append((head, key, 1.0, 3))
    return [*shown, ("pareto T", "pareto_ttft", 1.0, 0), ("pareto G", "pareto_cost", 1.0, 0)]


def format_rows(sweep: Sweep, rows: list[dict[str, Any]]) -> str:
    """The terminal table, each quantity in one column: ``#`` (the configuration's number:
    its row in the CSV and JSON, its mark in the PNG), grid values, the main metrics and the
    cluster's numbers that no other column shows (the CSV and JSON keep every ``cluster.*``
    column); * marks a Pareto-optimal row (T: throughput vs p99 TTFT, G: goodput vs GPUs)."""
    shown = _columns(sweep, rows)
    table = [["#"] + [head for head, *_ in shown] + ["error"]]
    for number, row in enumerate(rows, 1):
        table.append([str(number)]
                     + [_cell(row.get(key), scale, digits) for _, key, scale, digits in shown]
                     + [row["error"]])
    widths = [max(len(line[j]) for line in table) for j in range(len(shown) + 1)]
    return "\n".join(("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=False))
                      + (f"  {line[-1]}" if line[-1] else "")).rstrip() for line in table)


def format_warnings(rows: list[dict[str, Any]]) -> list[str]:
    """One line per distinct warning, naming the ``#`` of every configuration that gave it
    (the CSV's and JSON's ``warnings`` column keeps them per row)."""
    warned: dict[str, list[str]] = {}
    for number, row in enumerate(rows, 1):
        for text in filter(None, row["warnings"].split(" | ")):
            warned.setdefault(text, []).append(f"#{number}")
    return [f"warning ({' '.join(numbers)}): {text}" for text, numbers in warned.items()]


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Refuse a ``[ray://]HOST:PORT`` that takes no connection (Ray itself would retry for
    minutes); names such as ``auto`` are left to Ray."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise RuntimeError(f"cannot reach Ray at --ray-address {address}: "
                           f"{exc.strerror or exc}") from None


def run(args: argparse.Namespace) -> int:
    sweep = build_sweep(args.grid, list(args.simulate_args))
    if args.workers is not None and (args.workers < 1 or args.ray_address):
        raise ValueError("--workers is for a local Ray, and at least 1 (on --ray-address the "
                         "cluster's CPUs decide)")
    if args.ray_address:
        check_reachable(args.ray_address)
    prefix = Path(args.out)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    import ray

    started = not ray.is_initialized()  # NOTE: a caller's Ray session is used, and kept
    try:
        if started and args.ray_address:
            ray.init(address=args.ray_address, logging_level="WARNING")
        elif started:  # NOTE: "local": a fresh Ray, never one a `ray start` left running
            ray.init(address="local", num_cpus=args.workers or os.cpu_count(),
                     include_dashboard=False, logging_level="WARNING")
    except (ConnectionError, TimeoutError) as exc:
        raise RuntimeError(f"cannot reach Ray at --ray-address {args.ray_address}: "
                           f"{exc}") from None
    try:
        rows = run_on_ray(sweep.configs, progress=not args.no_progress)
    finally:
        if started:
            ray.shutdown()
    mark_pareto(rows)
    write_table(sweep, rows, prefix)
    plotted = _plot(sweep, rows, f"{prefix}.png")
    print(format_rows(sweep, rows))
    failed = sum(1 for row in rows if row["error"])
    for line in format_warnings(rows):
        print(line)
    n_warned = sum(1 for row in rows if row["warnings"])
    print(f"kvloop sweep: {len(rows)} configurations, {failed} failed"
          + (f", {n_warned} with warnings (above; the CSV's warnings column)"
             if n_warned else "")
          + f"; wrote {prefix}.csv, {prefix}.json"
          + (f", {prefix}.png" if plotted else " (no plot: none succeeded)"))
    return 1 if failed else 0
