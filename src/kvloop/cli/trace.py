"""``kvloop trace plot | export | summary | view``: look at a JSONL step trace."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvloop.sim.load import load_note
from kvloop.sim.metrics import format_table, scheduler_rows
from kvloop.viz.summary import load_records, summarize_trace


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace",
        help="plot, export, summarise or view a step trace (JSONL from --trace-out)",
        description="Look at the step records a run wrote with --trace-out.",
    )
    tsub = p.add_subparsers(dest="trace_command", required=True, metavar="ACTION")

    plot = tsub.add_parser("plot", help="draw the step timeline as a PNG",
                           description="One row per request, one column per step, with "
                           "panels for tokens, KV blocks, queues and step time. Rows name "
                           "the tenant and priority a request arrived with; a request that "
                           "missed its TTFT target is marked at its deadline.")
    plot.add_argument("trace", metavar="TRACE.jsonl")
    plot.add_argument("-o", "--output", default="timeline.png", metavar="PNG")
    plot.add_argument("--steps", default=None, metavar="A:B",
                      help="half-open window of step numbers (default: the first 500)")
    plot.add_argument("--requests", default=None, metavar="N|ID,ID,...",
                      help="the first N requests active in the window, or these ids "
                      "(default: the first 100)")
    plot.add_argument("--x-axis", choices=["time", "step"], default="time",
                      help="time: seconds since the first arrival, each step as wide as it "
                      "took; step: one column per step (default: %(default)s)")
    plot.add_argument("--title", default=None,
                      help="(default: the steps, requests and seconds shown)")
    plot.set_defaults(func=run_plot)

    export = tsub.add_parser("export", help="write Chrome trace-event JSON (Perfetto)")
    export.add_argument("trace", metavar="TRACE.jsonl")
    export.add_argument("--chrome", required=True, metavar="OUT.json",
                        help="where to write the Chrome trace-event JSON")
    export.set_defaults(func=run_export)

    summary = tsub.add_parser("summary", help="the kvloop simulate metrics table of a trace",
                              description="The kvloop simulate metrics table of a trace, "
                              "with a row per tenant when the trace recorded tenants.")
    summary.add_argument("trace", metavar="TRACE.jsonl")
    summary.add_argument("--json", default=None, metavar="PATH",
                         help="write the metrics as JSON (default: none)")
    summary.add_argument("--slo-ttft", type=float, default=None,
                         help="TTFT SLO in seconds for goodput, replacing the targets the "
                         "trace recorded (default: the recorded ones, else none)")
    summary.add_argument("--slo-tpot", type=float, default=None,
                         help="TPOT SLO in seconds for goodput, replacing the recorded "
                         "targets (default: the recorded ones, else none)")
    summary.set_defaults(func=run_summary)

    view = tsub.add_parser("view", help="open the web view of a trace in a browser",
                           description="Serve a local page with a lane per request, a step "
                           "slider, the selected step's batch, KV blocks and decisions with "
                           "their reasons, and time series linked to the slider.")
    view.add_argument("trace", metavar="TRACE.jsonl")
    view.add_argument("--port", type=int, default=8020,
                      help="local port to serve on (0: any free one)")
    view.add_argument("--host", default="127.0.0.1", help="address to bind")
    view.add_argument("--no-browser", action="store_true",
                      help="only print the URL; do not open a browser")
    view.set_defaults(func=run_view)


def run_plot(args: argparse.Namespace) -> int:
    # NOTE: matplotlib loads only here, so other subcommands start fast.
    from kvloop.viz.grid import build_grid, parse_requests, parse_steps, select_window
    from kvloop.viz.timeline import plot_timeline

    steps = parse_steps(args.steps) if args.steps is not None else None
    requests = parse_requests(args.requests) if args.requests is not None else None
    records = load_records(args.trace)
    window = select_window(records, steps, requests)
    grid = build_grid(records, window)
    plot_timeline(grid, args.output, title=args.title, x_axis=args.x_axis)
    rows, cols = grid.cells.shape
    print(f"kvloop trace plot: {rows} requests x {cols} steps "
          f"({grid.steps[0]}:{grid.steps[-1] + 1}) -> {args.output}")
    if grid.ids_cut:
        legend = Path(args.output).with_suffix(".rows.tsv")
        legend.write_text(rows_legend(grid), encoding="utf-8")
        print(f"rows are labelled with short ids; full ids -> {legend}")
    if window.notes:
        print("note: " + "; ".join(window.notes))
    return 0


def rows_legend(grid) -> str:
    """Tab-separated row number, full request id and arrival (seconds since the first);
    plus the full tenant and the priority when the trace recorded any."""
    extra = any(grid.suffixes())
    lines = ["row\trequest_id\tarrival_s" + ("\ttenant\tpriority" if extra else "")]
    infos = grid.infos or [None] * len(grid.request_ids)
    for n, rid, arrival, info in zip(grid.numbers, grid.request_ids, grid.arrivals, infos,
                                     strict=True):
        when = "" if arrival is None else f"{arrival - grid.t0:.3f}"
        line = f"{n}\t{rid}\t{when}"
        if extra and info is not None:
            line += f"\t{info.tenant}\t{info.priority}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def run_export(args: argparse.Namespace) -> int:
    from kvloop.viz.chrome import write_chrome_trace

    records = load_records(args.trace)
    doc = write_chrome_trace(records, args.chrome)
    info = doc["otherData"]
    print(f"kvloop trace export: {info['num_steps']} steps, {info['num_requests']} request "
          f"tracks, {len(doc['traceEvents'])} events -> {args.chrome} "
          "(open in https://ui.perfetto.dev or chrome://tracing)")
    return 0


def run_summary(args: argparse.Namespace) -> int:
    records = load_records(args.trace)
    m = summarize_trace(records, slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot)
    n = sum(m.get(k, 0) for k in ("completed", "aborted", "failed", "rejected", "unfinished"))
    print(f"kvloop trace summary: {n} requests over {len(records)} steps from {args.trace}")
    print(format_table(m, scheduler_rows(m["scheduler"])))
    note = load_note(m["load"])
    if note:
        print(note)
    if m["unfinished"]:
        print(f"note: {m['unfinished']} requests did not finish within the trace (not counted)")
    if m["requests_without_arrival"]:
        print(f"note: {m['requests_without_arrival']} requests have no arrival record; their "
              "arrival is taken as the first step that saw them")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(m, f, indent=2)
    return 0


def run_view(args: argparse.Namespace) -> int:
    from kvloop.viz.web.trace_view import serve_trace

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be 0-65535, got {args.port}")
    return serve_trace(args.trace, load_records(args.trace), host=args.host, port=args.port,
                       open_browser=not args.no_browser)
