"""Scheduling policies side by side in the simulator.

Llama-3.1-8B on one H100 (the simulator's fitted cost model, vLLM's engine overhead), KV
pool from 90% of the memory, 4 GiB swap, an 8192-token step budget and 256 sequences. For
each shipped trace (Azure conversation, Azure code, Mooncake, ShareGPT lengths):

1. A window: the trace's first ``--requests`` requests (arrival times as recorded; ShareGPT
   has none and gets Poisson arrivals), requests longer than the model's 131072 tokens left
   out. Each request gets a tenant (``t0`` sends 60%, ``t1``..``t9`` 4.4% each) and a
   priority (20% priority 0, 80% priority 1), both seeded.
2. Saturation: the window's measured service rate, i.e. the requests per second the
   vLLM-like configuration (fcfs, newest-first recompute) completes with the whole window
   queued at t=0. Loads 0.7x, 1.0x and 1.3x scale the trace's arrivals to that fraction of
   it (the trace's burstiness is kept).
3. SLOs per trace: TTFT = 5x the unloaded prefill time of the window's median prompt; TPOT =
   3x the unloaded decode step (one request, median prompt + half the median output cached).
4. Every policy configuration at every load: fcfs, prefill-first (fcfs admitting prompts
   before decodes, SGLang-like), priority, slo (defer), fair, each with cost-aware
   preemption off (newest-first, vLLM's rule) and on.

Goodput is requests that met both SLOs per second of the arrival window (first to last
arrival: the same denominator for every policy at a load, so a policy that drains its queue
later or rejects requests is neither rewarded nor punished by its own run length). Jain's
index is over the light tenants' service (prompt + output tokens served while requests
arrive; ``kvloop.sim.metrics``); the heavy share is ``t0``'s share of all service then.

Writes ``docs/policies.md`` (tables, targets; text after the ``HAND-WRITTEN`` marker is
kept), ``docs/img/policies_goodput.png`` and ``docs/img/policies_tenants.png``, and prints
the tables and the targets with whether each holds.

    python benchmarks/policies.py [--requests 1500] [--workers 2] [--quick] [--json PATH]
        [--no-docs]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvloop.cli.simulate import build_configs
from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.engine.args import EngineArgs
from kvloop.executor.simulated import (
    CostModel,
    engine_overhead,
    get_hardware_spec,
    get_model_spec,
)
from kvloop.sim.driver import simulate
from kvloop.sim.metrics import jain_index, tenant_service_over_time
from kvloop.sim.traces import WorkloadRequest, load_trace
from kvloop.sim.workloads import apply_priority_mix, apply_tenant_mix

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "policies.md"
IMG = ROOT / "docs" / "img"
MARKER = "<!-- HAND-WRITTEN: everything below this line is kept when the script rewrites -->"

MODEL, GPU = "llama-3.1-8b", "h100"
TRACES = ("azure-conv", "azure-code", "mooncake", "sharegpt")
LOADS = (0.7, 1.0, 1.3)
TENANT_MIX = [0.6] + [0.4 / 9] * 9
PRIORITY_MIX = {0: 0.2, 1: 0.8}
SEED = 0
POLICIES: dict[str, dict[str, str]] = {
    "fcfs": {"scheduling_policy": "fcfs"},
    "prefill-first": {"scheduling_policy": "fcfs", "scheduling_order": "prefill-first"},
    "priority": {"scheduling_policy": "priority"},
    "slo": {"scheduling_policy": "slo"},
    "fair": {"scheduling_policy": "fair"},
}
CONFIGS = [(policy, cost) for policy in POLICIES for cost in (False, True)]
BASELINE = ("fcfs", False)  # vLLM-like: FCFS, newest-first recompute
EQUAL_TTFT = 1.02  # "equal or better p99 TTFT": within 2%
TTFT_FACTOR, TPOT_FACTOR = 5.0, 3.0


def label(policy: str, cost: bool) -> str:
    """``fcfs/newest`` or ``fcfs/cost``: the policy and its preemption rule."""
    return f"{policy}/{'cost' if cost else 'newest'}"


def cost_model() -> CostModel:
    return CostModel(get_model_spec(MODEL), get_hardware_spec(GPU),
                     overhead=engine_overhead("vllm"))


def configs(policy: str, cost: bool, slos: tuple[float, float]
            ) -> tuple[SchedulerConfig, CacheConfig]:
    """The engine's configs for one run (the device supplies max_model_len and the pool)."""
    ea = EngineArgs(max_num_batched_tokens=8192, slo_ttft=slos[0], slo_tpot=slos[1],
                    cost_aware_preemption=cost, **POLICIES[policy])  # type: ignore[arg-type]
    return build_configs(ea, get_model_spec(MODEL), get_hardware_spec(GPU), 1)


def window(trace: str, n: int) -> list[WorkloadRequest]:
    """The trace's first ``n`` requests that fit the model, with tenants and priorities."""
    max_len = get_model_spec(MODEL).max_position_embeddings
    rows = [w for w in load_trace(trace, num_requests=n, seed=SEED)
            if len(w.prompt_token_ids) + w.output_len <= max_len]
    apply_tenant_mix(rows, TENANT_MIX, seed=SEED)
    apply_priority_mix(rows, PRIORITY_MIX, seed=SEED)
    return rows


def at_rate(base: list[WorkloadRequest], trace: str, rate: float) -> list[WorkloadRequest]:
    """The window with its arrivals scaled to ``rate`` req/s (inf: all at t=0). Traces
    without timestamps get Poisson arrivals at ``rate``."""
    if math.isinf(rate):
        return [replace(w, arrival_time=0.0) for w in base]
    if trace == "sharegpt":
        times = [w.arrival_time for w in load_trace(trace, num_requests=len(base),
                                                    request_rate=rate, seed=SEED)]
        return [replace(w, arrival_time=t) for w, t in zip(base, times, strict=True)]
    span = base[-1].arrival_time - base[0].arrival_time
    scale = rate * span / (len(base) - 1)  # rate_scale: divide the gaps by it
    t0 = base[0].arrival_time
    return [replace(w, arrival_time=(w.arrival_time - t0) / scale) for w in base]


def slos(base: list[WorkloadRequest]) -> tuple[float, float]:
    """(TTFT, TPOT) targets: multiples of the unloaded median prefill and decode step."""
    cm = cost_model()
    prompt = int(statistics.median(len(w.prompt_token_ids) for w in base))
    output = int(statistics.median(w.output_len for w in base))
    return (TTFT_FACTOR * cm.prefill_time(prompt),
            TPOT_FACTOR * cm.decode_step_time(1, prompt + output // 2))


def run_one(task: dict[str, Any]) -> dict[str, Any]:
    """One simulation; returns its row (or the error, so one failure does not stop all)."""
    trace, policy, cost, load = task["trace"], task["policy"], task["cost"], task["load"]
    base = window(trace, task["requests"])
    row: dict[str, Any] = {"trace": trace, "policy": policy, "cost": cost, "load": load,
                           "label": label(policy, cost)}
    started = time.perf_counter()
    try:
        sched, cache = configs(policy, cost, task["slos"])
        work = at_rate(base, trace, task["rate"])
        result = simulate(work, sched, cache, cost_model())
    except Exception as exc:  # reported in the table, not fatal
        row["error"] = f"{type(exc).__name__}: {exc}"
        return row
    m = result.metrics
    arrivals = [w.arrival_time for w in work]
    span = max(arrivals) - min(arrivals)
    good = round(m["goodput"] * m["duration"]) if m["goodput"] is not None else 0
    tenants = m["tenants"]
    light = [tenants[name]["service_tokens"] for name in tenants if name != "t0"]

    def met(names: list[str]) -> float | None:
        """Share of these tenants' requests that met both SLOs."""
        n = sum(tenants[name]["requests"] for name in names)
        ok = sum((tenants[name]["goodput"] or 0) * m["duration"] for name in names)
        return round(ok) / n if n else None

    row.update(
        requests=len(work), completed=m["completed"], rejected=m["rejected"],
        good=good, goodput=good / span if span > 0 else m["goodput"],
        attainment=good / len(work), duration=m["duration"],
        ttft_p50=m["ttft"]["p50"], ttft_p99=m["ttft"]["p99"],
        tpot_p50=m["tpot"]["p50"], tpot_p99=m["tpot"]["p99"],
        preemptions=m["scheduler"]["num_preemptions"],
        recomputed=m["scheduler"]["recomputed_tokens"],
        swapped=m["scheduler"]["swapped_out_blocks"],
        recompute_prefix_hits=m["scheduler"]["recompute_prefix_hits"],
        preemptions_avoided=getattr(result.scheduler.stats, "num_preemptions_avoided", None),
        jain_light=jain_index(light), heavy_share=tenants["t0"]["share"],
        met_heavy=met(["t0"]), met_light=met([name for name in tenants if name != "t0"]),
        jain_all=m["jain_index"], wall_s=time.perf_counter() - started,
    )
    if task.get("series"):
        starts, series = tenant_service_over_time(result.requests, bin_s=max(span / 40, 1e-3))
        row["series"] = {"starts": starts, "tenants": series, "span": span}
    return row


def saturation(task: dict[str, Any]) -> dict[str, Any]:
    """The window's service rate under the vLLM-like configuration, everything queued."""
    out = run_one(task | {"policy": BASELINE[0], "cost": BASELINE[1], "load": math.inf,
                          "rate": math.inf})
    if "error" in out:
        raise RuntimeError(f"saturation run failed on {task['trace']}: {out['error']}")
    return {"trace": task["trace"], "rate": out["completed"] / out["duration"],
            "wall_s": out["wall_s"]}


# -- tables -------------------------------------------------------------------------------


def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def run_table(rows: list[dict[str, Any]], trace: str) -> str:
    """One trace's runs as a Markdown table."""
    head = ("| load | policy/preemption | goodput req/s | SLO met | TTFT p50/p99 ms | "
            "TPOT p50/p99 ms | preempt. | recomputed tok | rejected | Jain light | heavy share "
            "| SLO met light / heavy |")
    lines = [head, "|" + "---|" * 12]
    for r in sorted((r for r in rows if r["trace"] == trace),
                    key=lambda r: (r["load"], CONFIGS.index((r["policy"], r["cost"])))):
        if "error" in r:
            lines.append(f"| {r['load']}x | {r['label']} | error: {r['error'][:80]} |"
                         + " |" * 10)
            continue
        lines.append(
            f"| {r['load']}x | {r['label']} | {r['goodput']:.2f} | {100 * r['attainment']:.0f}% "
            f"| {_ms(r['ttft_p50'])} / {_ms(r['ttft_p99'])} "
            f"| {_ms(r['tpot_p50'])} / {_ms(r['tpot_p99'])} | {r['preemptions']} "
            f"| {r['recomputed']} | {r['rejected']} | {_f(r['jain_light'], '.3f')} "
            f"| {_f(r['heavy_share'], '.1%')} "
            f"| {_f(r['met_light'], '.0%')} / {_f(r['met_heavy'], '.0%')} |"
        )
    return "\n".join(lines)


def _get(rows: list[dict[str, Any]], trace: str, load: float, policy: str, cost: bool
         ) -> dict[str, Any] | None:
    for r in rows:
        if (r["trace"], r["load"], r["policy"], r["cost"]) == (trace, load, policy, cost):
            return None if "error" in r else r
    return None


def demand_jain(base: list[WorkloadRequest]) -> float | None:
    """Jain's index over the light tenants' *demand* (prompt + output tokens they send): the
    most a policy can reach for tenants that are not backlogged (each is served what it
    asks for)."""
    demand: dict[str, int] = {}
    for w in base:
        if w.tenant != "t0":
            demand[w.tenant] = demand.get(w.tenant, 0) + len(w.prompt_token_ids) + w.output_len
    return jain_index(demand.values())


def targets(rows: list[dict[str, Any]]) -> tuple[list[str], dict[str, bool]]:
    """The three targets: lines of evidence and whether each holds."""
    lines, verdict = [], {}
    top = max(LOADS)
    # 1. slo goodput >= 1.5x fcfs at the top load on >= 3 of 4 traces
    wins = 0
    lines.append(f"1. At {top}x load, slo (cost-aware, defer) goodput >= 1.5x fcfs/newest "
                 "(vLLM-like) on >= 3 of 4 traces:")
    for trace in TRACES:
        s, f = _get(rows, trace, top, "slo", True), _get(rows, trace, top, *BASELINE)
        if s is None or f is None:
            lines.append(f"   - {trace}: missing run")
            continue
        ratio = s["goodput"] / f["goodput"] if f["goodput"] > 0 else math.inf
        ok = ratio >= 1.5
        wins += ok
        lines.append(f"   - {trace}: slo {s['goodput']:.2f} vs fcfs {f['goodput']:.2f} req/s "
                     f"= {ratio:.2f}x {'(holds)' if ok else '(misses)'}")
    verdict["slo goodput"] = wins >= 3
    lines.append(f"   -> {wins} of {len(TRACES)} traces: "
                 f"{'MET' if verdict['slo goodput'] else 'NOT MET'}")
    # 2. fair Jain >= 0.95 for light tenants while fcfs gives the heavy ~60%
    lines.append(f"2. At {top}x load, fair (cost-aware) keeps Jain >= 0.95 over the light "
                 "tenants while fcfs/newest lets the heavy tenant take ~60% (55-65%):")
    ok_all = True
    for trace in TRACES:
        fa, f = _get(rows, trace, top, "fair", True), _get(rows, trace, top, *BASELINE)
        if fa is None or f is None:
            lines.append(f"   - {trace}: missing run")
            ok_all = False
            continue
        ok = (fa["jain_light"] or 0) >= 0.95 and 0.55 <= (f["heavy_share"] or 0) <= 0.65
        ok_all &= ok
        lines.append(
            f"   - {trace}: fair Jain(light) {_f(fa['jain_light'], '.3f')}, heavy share "
            f"{_f(fa['heavy_share'], '.1%')}; fcfs Jain(light) {_f(f['jain_light'], '.3f')}, "
            f"heavy share {_f(f['heavy_share'], '.1%')} {'(holds)' if ok else '(misses)'}")
    verdict["fair"] = ok_all
    lines.append(f"   -> {'MET' if ok_all else 'NOT MET'}")
    # 3. cost-aware recomputes >= 30% fewer tokens than newest-first, p99 TTFT equal/better
    lines.append("3. Cost-aware preemption recomputes >= 30% fewer tokens than newest-first "
                 f"at equal (within {100 * (EQUAL_TTFT - 1):.0f}%) or better p99 TTFT, per "
                 "(trace, load, policy) where newest-first recomputed anything:")
    cells = held = 0
    tot_new = tot_cost = 0
    for trace in TRACES:
        for load in LOADS:
            for policy in POLICIES:
                n, c = (_get(rows, trace, load, policy, False),
                        _get(rows, trace, load, policy, True))
                if n is None or c is None or n["recomputed"] == 0:
                    continue
                cells += 1
                tot_new += n["recomputed"]
                tot_cost += c["recomputed"]
                fewer = 1 - c["recomputed"] / n["recomputed"]
                ttft_ok = (c["ttft_p99"] or 0) <= EQUAL_TTFT * (n["ttft_p99"] or 0)
                ok = fewer >= 0.30 and ttft_ok
                held += ok
                lines.append(
                    f"   - {trace} {load}x {policy}: recomputed {n['recomputed']} -> "
                    f"{c['recomputed']} ({fewer:.0%} fewer), p99 TTFT {_ms(n['ttft_p99'])} -> "
                    f"{_ms(c['ttft_p99'])} ms {'(holds)' if ok else '(misses)'}")
    if cells == 0:
        lines.append("   - no run preempted with newest-first: nothing to compare")
    verdict["cost-aware preemption"] = cells > 0 and held == cells
    total = (f"; all cells together {tot_new} -> {tot_cost} recomputed tokens "
             f"({1 - tot_cost / tot_new:.0%} fewer)") if tot_new else ""
    lines.append(f"   -> holds in {held} of {cells} cells{total}: "
                 f"{'MET' if verdict['cost-aware preemption'] else 'NOT MET'}")
    return lines, verdict


# -- plots --------------------------------------------------------------------------------


def plot_goodput(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TRACES), figsize=(4.2 * len(TRACES), 3.8))
    colors = dict(zip(POLICIES, ("C0", "C1", "C2", "C3", "C4"), strict=True))
    for ax, trace in zip(axes, TRACES, strict=True):
        for policy, cost in CONFIGS:
            pts = [(r["load"], r["goodput"]) for r in rows
                   if (r["trace"], r["policy"], r["cost"]) == (trace, policy, cost)
                   and "error" not in r]
            if pts:
                pts.sort()
                ax.plot(*zip(*pts, strict=True), marker="o" if cost else "x",
                        linestyle="-" if cost else "--", color=colors[policy],
                        label=label(policy, cost))
        ax.set_title(trace)
        ax.set_xlabel("load (x saturation)")
        ax.set_xticks(LOADS)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("goodput (req/s meeting TTFT and TPOT)")
    axes[-1].legend(fontsize=7, loc="best")
    fig.suptitle("Goodput vs load, Llama-3.1-8B on H100 (simulated); solid: cost-aware "
                 "preemption, dashed: newest-first")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tenants(rows: list[dict[str, Any]], trace: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    picks = [r for r in rows if r["trace"] == trace and "series" in r]
    picks.sort(key=lambda r: CONFIGS.index((r["policy"], r["cost"])))
    if not picks:
        return
    fig, axes = plt.subplots(1, len(picks), figsize=(6 * len(picks), 3.8), sharey=True)
    for ax, r in zip(list(axes) if len(picks) > 1 else [axes], picks, strict=True):
        s = r["series"]
        starts = s["starts"]
        width = starts[1] - starts[0] if len(starts) > 1 else 1.0
        t0 = starts[0]
        xs = [t - t0 for t in starts]
        heavy = [v / width for v in s["tenants"].get("t0", [0] * len(xs))]
        lights = [name for name in s["tenants"] if name != "t0"]
        ax.plot(xs, heavy, color="C3", label="heavy tenant t0 (60% of requests)")
        for i, name in enumerate(lights):
            ax.plot(xs, [v / width for v in s["tenants"][name]], color="C0", alpha=0.5,
                    linewidth=0.8, label="light tenants t1..t9 (4.4% each)" if i == 0 else None)
        ax.axvline(s["span"], color="k", linestyle=":", linewidth=0.8, label="last arrival")
        ax.set_title(f"{r['label']}: heavy share {_f(r['heavy_share'], '.0%')}, "
                     f"Jain(light) {_f(r['jain_light'], '.3f')}")
        ax.set_xlabel("time (s)")
        ax.grid(alpha=0.3)
    (axes[0] if len(picks) > 1 else axes).set_ylabel("tokens served per second")
    (axes[-1] if len(picks) > 1 else axes).legend(fontsize=7)
    fig.suptitle(f"Per-tenant service over time, {trace} at {picks[0]['load']}x load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the document -------------------------------------------------------------------------


def write_doc(rows: list[dict[str, Any]], sat: dict[str, dict[str, Any]],
              slo: dict[str, tuple[float, float]], target_lines: list[str],
              args: argparse.Namespace, wall_s: float, tenant_trace: str) -> None:
    kept = ""
    if DOC.exists():
        text = DOC.read_text()
        if MARKER in text:
            kept = text.split(MARKER, 1)[1]
    setup = "\n".join(
        f"| {t} | {sat[t]['n']} | {sat[t]['span']:.0f} | {sat[t]['rate']:.2f} | "
        f"{slo[t][0] * 1000:.0f} | {slo[t][1] * 1000:.1f} | {sat[t]['demand_jain']:.3f} |"
        for t in TRACES)
    parts = [
        "# Scheduling policies side by side (simulated)",
        "",
        "Generated by `python benchmarks/policies.py"
        + (f" --requests {args.requests}" if args.requests != 1500 else "")
        + f"` ({len(rows)} simulations, {wall_s:.0f} s on {args.workers} worker(s)); "
        "the method is in the script's docstring. Llama-3.1-8B on one H100 (fitted cost "
        "model, vLLM's engine overhead), 8192-token steps, 256 sequences, KV pool from 90% "
        "of memory, 4 GiB swap (recompute preemption unless a run says swap). Tenants: `t0` "
        "sends 60% of the requests, `t1`..`t9` 4.4% each; priorities: 20% priority 0, 80% "
        "priority 1 (used by `priority` only).",
        "",
        "**Saturation** is measured, not searched: the requests/s the vLLM-like configuration "
        "(fcfs, newest-first recompute) completes when the whole window is queued at t=0. "
        "Loads scale the trace's own arrivals (ShareGPT: Poisson) to 0.7x / 1.0x / 1.3x of it. "
        "**SLOs** per trace: TTFT = 5x the unloaded prefill of the window's median prompt, "
        "TPOT = 3x the unloaded decode step (one request). **Goodput** = requests meeting both "
        "SLOs per second of the arrival window (the same denominator for every policy at a "
        "load). **Jain light** = Jain's index over the nine light tenants' service (prompt + "
        "output tokens served while requests arrive); **heavy share** = `t0`'s share of all "
        "service in that window. `newest` = newest-first victim (vLLM's rule, "
        "`--no-cost-aware-preemption`); `cost` = cost-aware preemption (the default).",
        "",
        "| trace | requests in window | window (trace s) | saturation req/s | TTFT SLO ms "
        "| TPOT SLO ms | Jain of light demand |",
        "|---|---|---|---|---|---|---|",
        setup,
        "",
        "## Targets",
        "",
        "```",
        *target_lines,
        "```",
        "",
        "## Goodput vs load",
        "",
        "![goodput vs load per policy](img/policies_goodput.png)",
        "",
        "## Per-tenant service over time",
        "",
        "![per-tenant service, fcfs vs fair](img/policies_tenants.png)",
        "",
        f"({tenant_trace} at {max(LOADS)}x: tokens served per second per tenant.)",
        "",
    ]
    for trace in TRACES:
        parts += [f"## {trace}", "", run_table(rows, trace), ""]
    DOC.write_text("\n".join(parts) + "\n" + MARKER + (kept or "\n"))


# -- main ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1500,
                   help="requests per trace window (default: %(default)s)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--quick", action="store_true",
                   help="200-request windows, no docs: a smoke test")
    p.add_argument("--traces", nargs="+", default=list(TRACES), choices=TRACES)
    p.add_argument("--tenant-trace", default="azure-conv", choices=TRACES,
                   help="trace of the per-tenant service picture (default: %(default)s)")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--no-docs", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.no_docs = 200, True
    started = time.perf_counter()
    ctx = multiprocessing.get_context("fork")
    bases = {t: window(t, args.requests) for t in args.traces}
    slo = {t: slos(bases[t]) for t in args.traces}
    with ctx.Pool(args.workers) as pool:
        sat_rows = pool.map(saturation, [{"trace": t, "requests": args.requests,
                                          "slos": slo[t]} for t in args.traces])
        sat = {}
        for s in sat_rows:
            base = bases[s["trace"]]
            s["n"] = len(base)
            s["span"] = base[-1].arrival_time - base[0].arrival_time
            s["demand_jain"] = demand_jain(base)
            sat[s["trace"]] = s
            print(f"{s['trace']}: {s['n']} requests over {s['span']:.0f} trace s, saturation "
                  f"{s['rate']:.2f} req/s, SLOs TTFT {slo[s['trace']][0] * 1000:.0f} ms / "
                  f"TPOT {slo[s['trace']][1] * 1000:.1f} ms, Jain of light demand "
                  f"{s['demand_jain']:.3f}", file=sys.stderr)
        tasks = [
            {"trace": t, "policy": pol, "cost": cost, "load": load, "requests": args.requests,
             "rate": load * sat[t]["rate"], "slos": slo[t],
             "series": t == args.tenant_trace and load == max(LOADS)
             and (pol, cost) in (BASELINE, ("fair", True))}
            for t in args.traces for load in LOADS for pol, cost in CONFIGS
        ]
        tasks.sort(key=lambda task: (task["trace"] != "mooncake", -task["load"]))
        rows = []
        for i, row in enumerate(pool.imap_unordered(run_one, tasks), 1):
            rows.append(row)
            status = row.get("error") or (f"goodput {row['goodput']:.2f}, "
                                          f"{row['wall_s']:.1f} s")
            print(f"[{i}/{len(tasks)}] {row['trace']} {row['load']}x {row['label']}: {status}",
                  file=sys.stderr)
    wall = time.perf_counter() - started
    for trace in args.traces:
        print(f"\n## {trace} (saturation {sat[trace]['rate']:.2f} req/s)\n")
        print(run_table(rows, trace))
    target_lines, _ = targets(rows)
    print("\nTargets:")
    print("\n".join(target_lines))
    print(f"\n{len(rows)} runs in {wall:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"saturation": sat, "slos": slo, "rows": rows}, f, default=str)
    if not args.no_docs:
        IMG.mkdir(parents=True, exist_ok=True)
        plot_goodput(rows, IMG / "policies_goodput.png")
        plot_tenants(rows, args.tenant_trace, IMG / "policies_tenants.png")
        write_doc(rows, sat, slo, target_lines, args, wall, args.tenant_trace)
        print(f"wrote {DOC.relative_to(ROOT)} and docs/img/policies_*.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
