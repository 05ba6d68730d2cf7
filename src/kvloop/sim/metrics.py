"""Serving metrics over finished requests, with ARCHITECTURE.md's one meaning for each.

- TTFT: arrival to first output token (queueing and the whole prefill included).
- TPOT: per request, (e2e - TTFT) / (output tokens - 1); one-token requests have none.
- ITL: every gap between consecutive output tokens; aggregated over all gaps of all requests.
- e2e: arrival to last token. Queue time: arrival to first scheduled.
- Throughput: output (and, separately, total) tokens per second from the first arrival to
  the last completion. Goodput: completed requests per second that met every given SLO.
- Percentiles are nearest-rank; aborted, failed and rejected requests (finish reason
  ``rejected``: refused by the ``slo`` policy under overload; they have no first token) are
  excluded and counted apart, so a rejected request never counts as good.
- Per tenant (requests that name one): requests, service, goodput, TTFT and share. A
  tenant's *service* is the prompt + output tokens it was served while requests were still
  arriving (first to last arrival; the whole run when all arrive at once): a prompt counts
  when its first token comes, each output token when it comes; recomputation is not
  service. Jain's fairness index over tenants is (Σx)² / (n·Σx²) with x = service / weight.
- As the papers define them (``kvloop.sim.published_metrics``): SLO attainment
  (DistServe), QoE (Andes) and, with tenants, VTC's service gap between tenants while
  they are backlogged, with each tenant's service rate over its backlogged windows.

Times are seconds in the summary; :func:`format_table` shows latencies in ms.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvloop.sim.load import load_rows
from kvloop.sim.published_metrics import (
    SERVICE_WEIGHTS,
    WINDOW_S,
    qoe_summary,
    slo_attainment,
    vtc_gap,
)
from kvloop.sim.timeline import StepTimeline

__all__ = [
    "LATENCY_METRICS",
    "PERCENTILES",
    "format_table",
    "jain_index",
    "percentile",
    "request_service",
    "summarize_requests",
    "tenant_service_over_time",
]

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e", "queue")
"""Latency groups in a summary, each a dict of mean, p50, p90, p99 (seconds) and count."""
PERCENTILES = (50, 90, 99)
"""Percentiles reported for every latency group."""

_COMPLETED = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH"})
_ABORTED = "FINISHED_ABORTED"
_FAILED = "FINISHED_ERROR"
_REJECTED = "FINISHED_REJECTED"


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least q% of values <= it.

    ``sorted_values`` must be sorted ascending and non-empty; ``q`` is in [0, 100]
    (q=0 gives the minimum).
    """
    if not sorted_values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    return sorted_values[_rank(q, len(sorted_values)) - 1]


def _rank(q: float, n: int) -> int:
    """The nearest rank (1-based) of percentile ``q`` among ``n`` values."""
    rank = math.ceil(q * n / 100 - 1e-9)  # tolerance for float error, e.g. 0.07 * 100
    return min(max(rank, 1), n)


def _stats(values: list[float],
           counted: Sequence[tuple[float, int]] = ()) -> dict[str, float | int | None]:
    """Mean and nearest-rank percentiles of ``values`` (sorted in place) together with
    ``counted``: (value, how many times) pairs."""
    if counted:
        return _counted_stats([*counted, *((v, 1) for v in values)])
    values.sort()
    out: dict[str, float | int | None] = {"count": len(values)}
    out["mean"] = sum(values) / len(values) if values else None
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q) if values else None
    return out


def _counted_stats(pairs: list[tuple[float, int]]) -> dict[str, float | int | None]:
    """``_stats`` of (value, how many times) pairs (at least one; sorted in place)."""
    pairs.sort()
    n = sum(c for _, c in pairs)
    out: dict[str, float | int | None] = {"count": n,
                                          "mean": sum(v * c for v, c in pairs) / n}
    ranks = [_rank(q, n) for q in PERCENTILES]
    seen, k = 0, 0
    for v, c in pairs:
        seen += c
        while k < len(ranks) and ranks[k] <= seen:
            out[f"p{PERCENTILES[k]}"] = v
            k += 1
    return out


def jain_index(values: Iterable[float]) -> float | None:
    """Jain's fairness index (Σx)² / (n·Σx²): 1 when all ``values`` are equal, 1/n when one
    has everything. None when there are no values or all are 0."""
    xs = list(values)
    square_sum = sum(x * x for x in xs)
    if not xs or square_sum <= 0:
        return None
    return sum(xs) ** 2 / (len(xs) * square_sum)


def _status_name(req: Any) -> str:
    status = req.status
    return str(getattr(status, "name", status))


def summarize_requests(
    requests: Iterable[Any],
    *,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    tenant_weights: dict[str, float] | None = None,
    window_s: float = WINDOW_S,
    service_weights: tuple[float, float] = SERVICE_WEIGHTS,
    timelines: Mapping[str, StepTimeline] | None = None,
) -> dict[str, Any]:
    """Summarise finished requests (duck-typed like ``kvloop.core.request.Request``).

    Returns a JSON-ready dict: counts ``completed``, ``aborted``, ``failed``, ``rejected`` (and
    ``unfinished``, requests not yet finished, which are ignored), ``duration`` (first arrival
    of any request to last completion), ``input_tokens``, ``output_tokens``,
    ``request_throughput``, ``output_throughput``, ``total_token_throughput`` and ``goodput``
    (per second; None when no time passed), ``preemptions`` and ``recomputed_tokens`` over
    completed requests, ``slo_ttft``/``slo_tpot`` as given, and one dict per name in
    ``LATENCY_METRICS`` with ``count``, ``mean``, ``p50``, ``p90``, ``p99`` (None when empty).
    Goodput counts completed requests whose TTFT <= ``slo_ttft`` and TPOT <= ``slo_tpot``
    (SLOs given as None are ignored; a one-token request meets any TPOT SLO); a request's
    own ``slo_ttft``/``slo_tpot`` (when it has one) overrides the default given here. With no
    SLO goodput equals the request throughput.

    When some request names a ``tenant``, ``tenants`` maps each tenant to ``requests``,
    ``completed``, ``rejected``, ``service_tokens`` (see the module docstring), ``share``
    (of all tenants' service), ``goodput``, ``ttft_mean`` and ``ttft_p99``, and
    ``jain_index`` is Jain's index over service / weight (``tenant_weights``, default 1);
    otherwise ``tenants`` is empty and ``jain_index`` None.

    ``slo_attainment`` (DistServe: fractions meeting both SLOs, TTFT, TPOT) and ``qoe``
    (Andes: mean and p10) are always there; with tenants, ``vtc`` is VTC's backlogged
    service gap over windows of ``window_s`` seconds with ``service_weights`` (prompt,
    output), and each tenant row adds ``backlogged_s`` and ``backlogged_rate`` (its
    weighted service per second over the windows it was backlogged throughout)
    (``kvloop.sim.published_metrics``); without tenants ``vtc`` is None.

    ``timelines`` (request id -> the step end times of the engine that served it, where
    every token time is a step end: the simulator's) lets inter-token latencies and QoE be
    worked out per step rather than per token, with the same figures.
    """
    requests = list(requests)
    counts = {"completed": 0, "aborted": 0, "failed": 0, "rejected": 0, "unfinished": 0}
    tenants = _tenant_rows(requests, slo_ttft, slo_tpot)
    ttft: list[float] = []
    tpot: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    queue: list[float] = []
    runs_of: dict[str, tuple[StepTimeline, list[tuple[int, int]]]] = {}
    """Request id -> its timeline and runs of steps, where known (QoE reads them too)."""
    spans: dict[int, tuple[StepTimeline, list[tuple[int, int]]]] = {}
    """Per timeline, the runs of consecutive steps requests got tokens in: the
    inter-token latencies inside them are that timeline's gaps."""
    first_arrival = math.inf
    last_done = -math.inf
    input_tokens = output_tokens = preemptions = recomputed = good = 0
    sub = operator.sub
    for req in requests:
        first_arrival = min(first_arrival, req.arrival_time)
        name = _status_name(req)
        if name not in _COMPLETED:
            counts[_NOT_COMPLETED.get(name, "unfinished")] += 1
            continue
        counts["completed"] += 1
        arrival = req.arrival_time
        times = req.token_times
        n_out = len(req.output_token_ids)
        first = req.first_token_time if req.first_token_time is not None else times[0]
        last = times[-1] if times else req.finished_time
        t_ttft, t_e2e = first - arrival, last - arrival
        ttft.append(t_ttft)
        e2e.append(t_e2e)
        if req.first_scheduled_time is not None:
            queue.append(req.first_scheduled_time - arrival)
        t_tpot = None
        if n_out > 1:
            t_tpot = (t_e2e - t_ttft) / (n_out - 1)
            tpot.append(t_tpot)
        if len(times) > 1:
            line = timelines.get(req.request_id) if timelines else None
            runs = line.runs(times) if line is not None else None
            if runs is None:
                itl.extend(map(sub, times[1:], times))  # map stops at the shorter
            else:
                runs_of[req.request_id] = (line, runs)
                spans.setdefault(id(line), (line, []))[1].extend(runs)
                if len(runs) > 1:
                    itl.extend(line.jumps(runs))
        if _meets(req, t_ttft, t_tpot, slo_ttft, slo_tpot):
            good += 1
        done = req.finished_time if req.finished_time is not None else last
        last_done = max(last_done, done)
        input_tokens += req.num_prompt_tokens
        output_tokens += n_out
        preemptions += getattr(req, "num_preemptions", 0)
        recomputed += getattr(req, "num_recomputed_tokens", 0)

    duration = last_done - first_arrival if counts["completed"] else 0.0

    def rate(x: int) -> float | None:
        return x / duration if duration > 0 else None

    summary: dict[str, Any] = dict(counts)
    summary.update(
        duration=duration,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        request_throughput=rate(counts["completed"]),
        output_throughput=rate(output_tokens),
        total_token_throughput=rate(input_tokens + output_tokens),
        goodput=rate(good),
        slo_ttft=slo_ttft,
        slo_tpot=slo_tpot,
        preemptions=preemptions,
        recomputed_tokens=recomputed,
    )
    itl_counted = [pair for line, of_line in spans.values() for pair in line.gap_counts(of_line)]
    for key, values in zip(LATENCY_METRICS, (ttft, tpot, itl, e2e, queue), strict=True):
        summary[key] = _stats(values, itl_counted if key == "itl" else ())
    weights = tenant_weights or {}
    for row in tenants.values():
        row["goodput"] = rate(row.pop("good"))
    summary["slo_attainment"] = slo_attainment(requests, slo_ttft, slo_tpot)
    summary["qoe"] = qoe_summary(requests, slo_ttft, slo_tpot, runs_of)
    summary["vtc"] = None
    if tenants:
        vtc = vtc_gap(requests, window_s=window_s, weights=service_weights,
                      tenant_weights=weights)
        for name, row in tenants.items():
            row.update(vtc["tenants"].get(name, {"backlogged_s": 0.0,
                                                 "backlogged_rate": None}))
        summary["vtc"] = {k: v for k, v in vtc.items() if k != "tenants"}
    summary["tenants"] = tenants
    summary["jain_index"] = jain_index(
        row["service_tokens"] / weights.get(name, 1.0) for name, row in tenants.items()
    ) if tenants else None
    return summary


_NOT_COMPLETED = {_ABORTED: "aborted", _FAILED: "failed", _REJECTED: "rejected"}


def _meets(
    req: Any, ttft: float, tpot: float | None, slo_ttft: float | None, slo_tpot: float | None
) -> bool:
    """Whether a completed request met its TTFT and TPOT targets (its own, else the given)."""
    own_ttft, own_tpot = getattr(req, "slo_ttft", None), getattr(req, "slo_tpot", None)
    ttft_target = own_ttft if own_ttft is not None else slo_ttft
    tpot_target = own_tpot if own_tpot is not None else slo_tpot
    return (ttft_target is None or ttft <= ttft_target) and (
        tpot_target is None or tpot is None or tpot <= tpot_target
    )


def _service_end(requests: Sequence[Any]) -> float:
    """Until when service counts towards fairness: the last arrival, or (all arriving at
    once) forever."""
    arrivals = [req.arrival_time for req in requests]
    if not arrivals or max(arrivals) <= min(arrivals):
        return math.inf
    return max(arrivals)


def request_service(req: Any, until: float = math.inf) -> int:
    """Tokens served to ``req`` up to time ``until``: its prompt once its first token came,
    plus each output token that came (recomputation excluded)."""
    first = req.first_token_time
    if first is None or first > until:
        return 0
    times = req.token_times
    if not times or times[-1] <= until:
        return req.num_prompt_tokens + len(req.output_token_ids)
    return req.num_prompt_tokens + sum(1 for t in times if t <= until)


def _tenant_rows(
    requests: Sequence[Any], slo_ttft: float | None, slo_tpot: float | None
) -> dict[str, dict[str, Any]]:
    """Per-tenant counts, service, TTFT and a good-request count (turned into goodput)."""
    if not any(getattr(req, "tenant", "") for req in requests):
        return {}
    until = _service_end(requests)
    rows: dict[str, dict[str, Any]] = {}
    ttfts: dict[str, list[float]] = {}
    for req in requests:
        name = getattr(req, "tenant", "") or ""
        row = rows.get(name)
        if row is None:
            row = rows[name] = {"requests": 0, "completed": 0, "rejected": 0,
                                "service_tokens": 0, "good": 0}
            ttfts[name] = []
        row["requests"] += 1
        status = _status_name(req)
        row["rejected"] += status == _REJECTED
        row["service_tokens"] += request_service(req, until)
        if status not in _COMPLETED:
            continue
        row["completed"] += 1
        times = req.token_times
        first = req.first_token_time if req.first_token_time is not None else times[0]
        t_ttft = first - req.arrival_time
        ttfts[name].append(t_ttft)
        n_out = len(req.output_token_ids)
        last = times[-1] if times else req.finished_time
        t_tpot = (last - first) / (n_out - 1) if n_out > 1 else None
        row["good"] += _meets(req, t_ttft, t_tpot, slo_ttft, slo_tpot)
    total = sum(row["service_tokens"] for row in rows.values())
    for name, row in rows.items():
        stats = _stats(ttfts[name])
        row["share"] = row["service_tokens"] / total if total else None
        row["ttft_mean"], row["ttft_p99"] = stats["mean"], stats["p99"]
    return dict(sorted(rows.items(), key=lambda kv: _tenant_key(kv[0])))


def _tenant_key(name: str) -> tuple[int, int, str]:
    """Sort t2 before t10 (numeric suffix), then other names alphabetically."""
    digits = name[1:] if name.startswith("t") else ""
    return (0, int(digits), name) if digits.isdigit() else (1, 0, name)


def tenant_service_over_time(
    requests: Iterable[Any], bin_s: float
) -> tuple[list[float], dict[str, list[int]]]:
    """Tokens served per tenant in bins of ``bin_s`` seconds from the first arrival (as for
    the fairness service: a prompt when its first token comes, each output token when it
    comes). Returns (bin start times, tenant -> tokens per bin)."""
    if not bin_s > 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s}")
    requests = list(requests)
    if not requests:
        return [], {}
    t0 = min(req.arrival_time for req in requests)
    events: list[tuple[str, float, int]] = []
    for req in requests:
        if req.first_token_time is None:
            continue
        name = getattr(req, "tenant", "") or ""
        events.append((name, req.first_token_time, req.num_prompt_tokens))
        events.extend((name, t, 1) for t in req.token_times)
    end = max((t for _, t, _ in events), default=t0)
    n = int((end - t0) // bin_s) + 1
    series: dict[str, list[int]] = {}
    for name, t, tokens in events:
        bins = series.setdefault(name, [0] * n)
        bins[min(int((t - t0) // bin_s), n - 1)] += tokens
    return [t0 + i * bin_s for i in range(n)], dict(
        sorted(series.items(), key=lambda kv: _tenant_key(kv[0])))


_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2e": ("End-to-end Latency", "E2EL"),
    "queue": ("Queue Time", "Queue"),
}
_WIDTH = 50


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_table(
    summary: dict[str, Any],
    extra: dict[str, Any] | None = None,
    *,
    title: str = "Serving Benchmark Result",
    load: dict[str, Any] | None = None,
    extra_title: str = "Scheduler",
) -> str:
    """Render a summary as a terminal table like vLLM's benchmark_serving (latencies in ms).

    A ``load`` entry (``kvloop.sim.load.load_summary``) adds a Load section: arrival rate
    and utilisation (the ``load`` argument, label -> value, replaces its rows: a cluster
    labels them its own way). ``extra`` key/values (e.g. scheduler stats: preemptions,
    prefix hit rate, KV usage) are appended in their own section, ``extra_title``, printed
    as given (floats with 4 decimals). ``title`` heads the table.
    """
    lines = [f"{' ' + title + ' ':=^{_WIDTH}}"]

    def row(label: str, value: Any, digits: int = 2) -> None:
        lines.append(f"{label + ':':<40}{_fmt(value, digits):>10}")

    row("Successful requests", summary.get("completed"))
    for key, label in (("aborted", "Aborted requests"), ("failed", "Failed requests"),
                       ("rejected", "Rejected requests (SLO)")):
        if summary.get(key):
            row(label, summary[key])
    row("Duration (s)", summary.get("duration"))
    row("Total input tokens", summary.get("input_tokens"))
    row("Total generated tokens", summary.get("output_tokens"))
    row("Request throughput (req/s)", summary.get("request_throughput"))
    if summary.get("slo_ttft") is not None or summary.get("slo_tpot") is not None:
        row("Request goodput (req/s)", summary.get("goodput"))
    att = summary.get("slo_attainment")
    if att and att.get("both") is not None and (
            summary.get("slo_ttft") is not None or summary.get("slo_tpot") is not None):
        for key, label in (("both", "SLO attainment"), ("ttft", "TTFT attainment"),
                           ("tpot", "TPOT attainment")):
            row(label, f"{100 * att[key]:.1f}%")
    qoe = summary.get("qoe")
    if qoe and qoe.get("mean") is not None:
        row("QoE (Andes) mean", qoe["mean"], 3)
        row("QoE (Andes) p10", qoe["p10"], 3)
    row("Output token throughput (tok/s)", summary.get("output_throughput"))
    row("Total token throughput (tok/s)", summary.get("total_token_throughput"))
    for key, (title, short) in _TITLES.items():
        stats = summary.get(key)
        if not stats:
            continue
        lines.append(f"{' ' + title + ' ':-^{_WIDTH}}")
        for stat in ("mean", *(f"p{q}" for q in PERCENTILES)):
            value = stats.get(stat)
            label = f"{'Mean' if stat == 'mean' else stat.upper()} {short} (ms)"
            row(label, None if value is None else value * 1000.0)
    if summary.get("tenants"):
        lines.append(f"{' Tenants ':-^{_WIDTH}}")
        lines.extend(_tenant_lines(summary["tenants"]))
        row("Jain's fairness index (service/weight)", summary.get("jain_index"), 4)
        vtc = summary.get("vtc")
        if vtc and vtc.get("windows"):
            row(f"VTC gap max, {vtc['window_s']:g} s windows", vtc["max_gap"], 0)
            row("VTC gap mean", vtc["mean_gap"], 0)
            row("Jain, backlogged windows (mean)", vtc["jain_mean"], 4)
    if summary.get("load"):
        lines.append(f"{' Load ':-^{_WIDTH}}")
        for key, value in (load_rows(summary["load"]) if load is None else load).items():
            row(key, value)
    if extra:
        lines.append(f"{' ' + extra_title + ' ':-^{_WIDTH}}")
        for key, value in extra.items():
            row(str(key), value, 4)
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def _tenant_lines(tenants: dict[str, dict[str, Any]]) -> list[str]:
    """One line per tenant: requests, service tokens and share, goodput, TTFT mean/p99."""
    lines = [f"{'Tenant':<8}{'Reqs':>6}{'Tokens':>10}{'Share':>7}{'Good/s':>7}"
             f"{'TTFT ms':>8}{'p99':>8}"]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    for name, row in tenants.items():
        share = "-" if row["share"] is None else f"{100 * row['share']:.1f}%"
        lines.append(
            f"{(name or '(none)')[:8]:<8}{row['requests']:>6}{row['service_tokens']:>10}"
            f"{share:>7}{_fmt(row['goodput']):>7}{ms(row['ttft_mean']):>8}"
            f"{ms(row['ttft_p99']):>8}"
        )
    return lines


def scheduler_rows(totals: dict[str, Any]) -> dict[str, Any]:
    """The scheduler section of the metrics table, from ``scheduler_summary``-shaped totals
    (``num_cpu_blocks`` may be missing: a trace does not know it)."""
    cpu = totals.get("num_cpu_blocks")
    return {
        "Steps": totals["num_steps"],
        "Preemptions (recompute / swap)":
            f"{totals['num_recompute_preemptions']} / {totals['num_swap_preemptions']}",
        "Recomputed tokens": totals["recomputed_tokens"],
        "Swapped blocks (out / in)":
            f"{totals['swapped_out_blocks']} / {totals['swapped_in_blocks']}",
        "Prefix cache hit rate": f"{100 * totals['prefix_cache_hit_rate']:.1f}%",
        "KV usage (mean / peak)":
            f"{100 * totals['kv_usage_mean']:.1f}% / {100 * totals['kv_usage_peak']:.1f}%",
        "KV blocks (device / host)": f"{totals['num_gpu_blocks']} / {'-' if cpu is None else cpu}",
    }
