"""Replicas behind a router: simulated clusters, and real ones here.

``--part sim``: ``kvloop simulate --replicas N --router NAME`` on the shipped Mooncake and
Azure conversation traces, N = 4, 8 and 16 replicas of Llama-3.1-8B on one H100 each (the
simulator's fitted cost model, vLLM's engine overhead, every other setting the command's
default), with the three routers of ``kvloop.cluster.routers``. Each run is the command
itself (``kvloop.cli.main``, its ``--json`` read back), so a row is exactly what a user gets
from the command line shown with it.

Load: the trace's arrival rate is scaled with the replica count, ``--rate-scale = k * N``,
so every replica is offered the same rate at every cluster size. k is per trace
(``PER_REPLICA_SCALE``), set from the round-robin baseline alone (not the router under
test): the k at which round-robin on 8 replicas builds a slowly growing queue, queue growth
about 0.01 s per s of arrivals, half the simulator's overload threshold (0.02,
``kvloop.sim.load``): busy, not overloaded. Tried on round-robin x8: Mooncake k = 0.25,
0.35, 0.40, 0.45 gave growth 0.001, 0.011, 0.039, 0.080; Azure conversation k = 2.5, 3.0,
3.5 gave 0.000, 0.0003, 0.011.

Reported per run: the cluster's prefix-cache hit rate (hit tokens / looked-up tokens, summed
over replicas), TTFT p50/p99, output token throughput, load imbalance (max/mean of the
replicas' busy time) and queue growth. The target: ``kv-aware`` reaches >= 1.5x the
hit rate of ``round-robin`` on Mooncake at 8 replicas, with p99 TTFT no worse than
``least-loaded``'s.

Also Mooncake at 8 replicas under a lighter load (``LIGHT_K``), shown apart with the target's
test applied to it: which router wins p99 TTFT depends on the load.

Writes the tables, the target and ``docs/img/cluster_sim.png`` into ``docs/cluster.md``
between ``<!-- sim:begin -->`` and ``<!-- sim:end -->`` (the rest of the page is kept).

``--part real``: 1 vs 2 Ray replicas of the default model on this machine at saturation
(``benchmarks/cluster_real.py``), between ``<!-- real:begin -->`` and ``<!-- real:end -->``.

    python benchmarks/cluster.py --part sim [--jobs 2] [--replicas 4 8 16]
        [--traces mooncake azure-conv] [--num-requests N] [--json PATH] [--no-docs]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvloop.cli import main as kvloop_main
from kvloop.cluster.routers import ROUTERS

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "cluster.md"
IMG = ROOT / "docs" / "img"
BEGIN, END = "<!-- sim:begin -->", "<!-- sim:end -->"

MODEL, GPU = "llama-3.1-8b", "h100"
TRACES = ("mooncake", "azure-conv")
REPLICAS = (4, 8, 16)
PER_REPLICA_SCALE = {"mooncake": 0.35, "azure-conv": 3.5}
"""k of ``--rate-scale = k * replicas``: each replica is offered k times the trace's rate."""
LIGHT_K = 0.25
"""A lighter load for Mooncake at 8 replicas, shown apart: the target checked off its load."""


def command(trace: str, replicas: int, router: str, num_requests: int | None,
            k: float) -> list[str]:
    """The ``kvloop simulate`` arguments of one run (``--json`` and ``--no-progress`` added
    when it runs)."""
    scale = round(k * replicas, 4)
    args = ["simulate", "--model", MODEL, "--gpu", GPU, "--trace", trace, "--rate-scale",
            f"{scale:g}", "--replicas", str(replicas), "--router", router]
    if num_requests is not None:
        args += ["--num-requests", str(num_requests)]
    return args


def run_one(task: tuple[str, int, str, int | None, float]) -> dict[str, Any]:
    """Run one configuration through the command line; its row of the tables."""
    trace, replicas, router, num_requests, k = task
    args = command(trace, replicas, router, num_requests, k)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "m.json"
        with contextlib.redirect_stdout(io.StringIO()):
            rc = kvloop_main([*args, "--json", str(out), "--no-progress"])
        if rc != 0:
            raise RuntimeError(f"kvloop {' '.join(args)} exited {rc}")
        m = json.loads(out.read_text())
    c, load = m["cluster"], m["load"]
    return {
        "trace": trace, "replicas": replicas, "router": router, "k": k,
        "command": "kvloop " + " ".join(args),
        "rate_scale": float(args[args.index("--rate-scale") + 1]),
        "requests": m["completed"] + m["failed"] + m["aborted"] + m["rejected"],
        "completed": m["completed"],
        "hit_rate": c["prefix_cache_hit_rate"],
        "ttft_p50": m["ttft"]["p50"], "ttft_p99": m["ttft"]["p99"],
        "output_throughput": m["output_throughput"],
        "request_throughput": m["request_throughput"],
        "imbalance": c["imbalance"],
        "queue_growth": load["queue_growth"], "overloaded": load["overloaded"],
        "preemptions": m["scheduler"]["num_preemptions"],
        "per_replica_requests": [row["requests"] for row in m["replicas"]],
        "wall_s": m["wall_time_s"],
    }


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def table(rows: list[dict[str, Any]], trace: str) -> str:
    """A markdown table of one trace's runs, by replica count then router."""
    head = ("| replicas | router | rate scale | prefix hit rate | TTFT p50 (ms) | TTFT p99 (ms) "
            "| output tok/s | imbalance | queue growth | sim wall (s) |")
    lines = [head, "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    order = {name: i for i, name in enumerate(ROUTERS)}
    for r in sorted((r for r in rows if r["trace"] == trace),
                    key=lambda r: (r["replicas"], order[r["router"]])):
        lines.append(
            f"| {r['replicas']} | {r['router']} | {r['rate_scale']:g} "
            f"| {100 * r['hit_rate']:.1f}% | {_ms(r['ttft_p50'])} | {_ms(r['ttft_p99'])} "
            f"| {_f(r['output_throughput'], '.0f')} | {_f(r['imbalance'], '.2f')} "
            f"| {_f(r['queue_growth'], '.3f')} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def target(rows: list[dict[str, Any]]) -> tuple[str, bool | None]:
    """The target on Mooncake at 8 replicas (of ``rows``, one load): a sentence and
    whether it holds."""
    cell = {r["router"]: r for r in rows if r["trace"] == "mooncake" and r["replicas"] == 8}
    if not {"round-robin", "least-loaded", "kv-aware"} <= cell.keys():
        return "not measured: needs Mooncake at 8 replicas with all three routers", None
    kv, rr, ll = cell["kv-aware"], cell["round-robin"], cell["least-loaded"]
    ratio = kv["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf")
    holds = ratio >= 1.5 and kv["ttft_p99"] <= ll["ttft_p99"]
    verdict = "both hold" if holds else "they do not both hold"
    return (f"Mooncake on 8 replicas: kv-aware's prefix hit rate is {100 * kv['hit_rate']:.1f}%, "
            f"{ratio:.2f}x round-robin's {100 * rr['hit_rate']:.1f}% (aim: >= 1.5x), and its "
            f"p99 TTFT {kv['ttft_p99'] * 1e3:.0f} ms against least-loaded's "
            f"{ll['ttft_p99'] * 1e3:.0f} ms (aim: no worse): {verdict}"), holds


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Hit rate and p99 TTFT against replica count, one line per router, a row per trace."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = [t for t in TRACES if any(r["trace"] == t for r in rows)]
    fig, axes = plt.subplots(len(traces), 2, figsize=(10, 3.6 * len(traces)), squeeze=False)
    for (ax_hit, ax_p99), trace in zip(axes, traces, strict=True):
        for router in ROUTERS:
            pts = sorted((r["replicas"], r["hit_rate"] * 100, r["ttft_p99"])
                         for r in rows if r["trace"] == trace and r["router"] == router)
            if not pts:
                continue
            n, hit, p99 = zip(*pts, strict=True)
            ax_hit.plot(n, hit, marker="o", label=router)
            ax_p99.plot(n, p99, marker="o", label=router)
        top = max(r["hit_rate"] * 100 for r in rows if r["trace"] == trace)
        ax_hit.set(title=f"{trace}: prefix-cache hit rate", xlabel="replicas", ylabel="%",
                   ylim=(0, max(5.0, 1.1 * top)))
        ax_p99.set(title=f"{trace}: p99 TTFT", xlabel="replicas", ylabel="seconds")
        ax_p99.set_yscale("log")
        ax_p99.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax_p99.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        for ax in (ax_hit, ax_p99):
            ax.set_xticks(sorted({r["replicas"] for r in rows}))
            ax.grid(alpha=0.3)
        ax_hit.legend()
    fig.suptitle(f"Simulated clusters of {MODEL} on {GPU}, rate scaled with replicas")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sim_section(rows: list[dict[str, Any]], line: str, light: list[dict[str, Any]],
                light_line: str) -> str:
    """The generated part of docs/cluster.md: ``rows`` and ``line`` at the chosen loads,
    ``light`` and ``light_line`` Mooncake at 8 replicas under ``LIGHT_K``."""
    k = ", ".join(f"{t} k = {PER_REPLICA_SCALE[t]:g}" for t in TRACES)
    out = [BEGIN, "", "## Simulated clusters", "",
           "Generated by `python benchmarks/cluster.py --part sim`: do not edit between the "
           "markers. Each row is one `kvloop simulate` run of the whole shipped trace, "
           f"N replicas of {MODEL} on {GPU} (the fitted cost model, vLLM engine overhead, "
           "other settings at their defaults), e.g.", "",
           "    kvloop " + " ".join(command("mooncake", 8, "kv-aware", None,
                                         PER_REPLICA_SCALE["mooncake"])), "",
           f"Load: `--rate-scale = k × N`, the same arrival rate per replica at every size "
           f"({k}), k set from round-robin alone: the k at which round-robin on 8 replicas "
           "builds a slowly growing queue (queue growth ≈ 0.01 s per s of arrivals, half the "
           "simulator's overload threshold): busy, not overloaded. Hit rate is over the "
           "cluster (hit / looked-up prompt tokens, summed); imbalance is max/mean busy time "
           "of the replicas; throughput counts output tokens. The Azure trace records lengths "
           "only, so its prompts share no tokens (hit rate 0 for every router): it compares "
           "load balancing alone.", "",
           f"**{line}**", ""]
    for trace in TRACES:
        if any(r["trace"] == trace for r in rows):
            out += [f"### {trace}", "", table(rows, trace), ""]
    if light:
        out += [f"### mooncake at 8 replicas, lighter load (k = {LIGHT_K:g})", "",
                "Not the target's load; shown because the p99 TTFT ordering changes here.", "",
                table(light, "mooncake"), "", light_line, ""]
    out += ["![hit rate and p99 TTFT against replicas](img/cluster_sim.png)", "", END]
    return "\n".join(out)


def write_doc(section: str) -> None:
    """Put ``section`` between the markers of docs/cluster.md (creating the page, or
    appending the markers, when they are missing); the rest of the page is kept."""
    if not DOC.exists():
        DOC.write_text("# Clusters: replicas behind a router\n\n"
                       "Many kvloop replicas behind one endpoint, routed by "
                       "`kvloop.cluster.routers` (`round-robin`, `least-loaded`, `kv-aware`); "
                       "the simulator runs the same router objects as the real cluster.\n\n"
                       f"{section}\n")
        return
    text = DOC.read_text()
    if BEGIN in text and END in text:
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        DOC.write_text(head + section + tail)
    else:
        DOC.write_text(text.rstrip("\n") + "\n\n" + section + "\n")


def sim(args: argparse.Namespace) -> None:
    """Run the simulated grid, print its tables and the target, and write the docs."""
    tasks = [(t, n, r, args.num_requests, PER_REPLICA_SCALE[t]) for t in args.traces
             for n in args.replicas for r in ROUTERS]
    if "mooncake" in args.traces and 8 in args.replicas:
        tasks += [("mooncake", 8, r, args.num_requests, LIGHT_K) for r in ROUTERS]
    tasks.sort(key=lambda task: (task[0] != "azure-conv", -task[1]))  # longest first
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with multiprocessing.Pool(args.jobs) as pool:
        for row in pool.imap_unordered(run_one, tasks):
            rows.append(row)
            print(f"  {row['trace']} x{row['replicas']} {row['router']}: "
                  f"{100 * row['hit_rate']:.1f}% hits, p99 TTFT {row['ttft_p99']:.2f} s "
                  f"({row['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    light = [r for r in rows if r["k"] != PER_REPLICA_SCALE[r["trace"]]]
    rows = [r for r in rows if r["k"] == PER_REPLICA_SCALE[r["trace"]]]
    for trace in args.traces:
        print(f"\n{trace}\n{table(rows, trace)}")
    line, _ = target(rows)
    light_line = ""
    if light:
        light_line = f"At the lighter load k = {LIGHT_K:g}: " + target(light)[0]
        print(f"\nmooncake, lighter load (k = {LIGHT_K:g})\n{table(light, 'mooncake')}")
    print(f"\n{line}\n{light_line}\n"
          f"(grid: {time.perf_counter() - started:.0f} s with {args.jobs} jobs)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows + light, indent=1))
    if not args.no_docs:
        if args.num_requests is not None:
            print("docs not written: --num-requests cuts the traces", file=sys.stderr)
            return
        IMG.mkdir(parents=True, exist_ok=True)
        plot(rows, IMG / "cluster_sim.png")
        write_doc(sim_section(rows, line, light, light_line))
        print(f"wrote {DOC.relative_to(ROOT)} and docs/img/cluster_sim.png")


def real(args: argparse.Namespace) -> None:
    """1 vs 2 real replicas with ``kvloop bench serve`` (``benchmarks/cluster_real.py``),
    written into docs/cluster.md between the ``real`` markers unless ``--no-docs``."""
    sys.path.insert(0, str(Path(__file__).parent))
    import cluster_real

    defaults = argparse.ArgumentParser()
    cluster_real.add_args(defaults)
    real_args = defaults.parse_args([])
    real_args.docs = None if args.no_docs else str(DOC)
    cluster_real.real(real_args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("sim", "real", "all"), default="sim",
                   help="which section to run (default: %(default)s)")
    p.add_argument("--jobs", type=int, default=2, help="simulations run at once (sim)")
    p.add_argument("--traces", nargs="+", choices=TRACES, default=list(TRACES))
    p.add_argument("--replicas", nargs="+", type=int, default=list(REPLICAS))
    p.add_argument("--num-requests", type=int, default=None,
                   help="cut each trace to its first N requests (a quick look; no docs)")
    p.add_argument("--json", default=None, help="write the sim rows as JSON")
    p.add_argument("--no-docs", action="store_true", help="do not rewrite docs/cluster.md")
    args = p.parse_args(argv)
    if args.part in ("sim", "all"):
        sim(args)
    if args.part in ("real", "all"):
        real(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
