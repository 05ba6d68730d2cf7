"""Serving metrics over finished requests, with ARCHITECTURE.md's one meaning for each.

- TTFT: arrival to first output token (queueing and the whole prefill included).
- TPOT: per request, (e2e - TTFT) / (output tokens - 1); one-token requests have none.
- ITL: every gap between consecutive output tokens; aggregated over all gaps of all requests.
- e2e: arrival to last token. Queue time: arrival to first scheduled.
- Throughput: output (and, separately, total) tokens per second from the first arrival to
  the last completion. Goodput: completed requests per second that met every given SLO.
- Percentiles are nearest-rank; aborted and failed requests are excluded and counted apart.

Times are seconds in the summary; :func:`format_table` shows latencies in ms.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from typing import Any

from kvloop.sim.load import load_rows

__all__ = ["LATENCY_METRICS", "PERCENTILES", "format_table", "percentile", "summarize_requests"]

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e", "queue")
"""Latency groups in a summary, each a dict of mean, p50, p90, p99 (seconds) and count."""
PERCENTILES = (50, 90, 99)
"""Percentiles reported for every latency group."""

_COMPLETED = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH"})
_ABORTED = "FINISHED_ABORTED"
_FAILED = "FINISHED_ERROR"


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least q% of values <= it.

    ``sorted_values`` must be sorted ascending and non-empty; ``q`` is in [0, 100]
    (q=0 gives the minimum).
    """
    if not sorted_values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    n = len(sorted_values)
    rank = math.ceil(q * n / 100 - 1e-9)  # tolerance for float error, e.g. 0.07 * 100
    return sorted_values[min(max(rank, 1), n) - 1]


def _stats(values: list[float]) -> dict[str, float | int | None]:
    """Mean and nearest-rank percentiles of ``values`` (sorted in place)."""
    values.sort()
    out: dict[str, float | int | None] = {"count": len(values)}
    out["mean"] = sum(values) / len(values) if values else None
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q) if values else None
    return out


def _status_name(req: Any) -> str:
    status = req.status
    return str(getattr(status, "name", status))


def summarize_requests(
    requests: Iterable[Any],
    *,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
) -> dict[str, Any]:
    """Summarise finished requests (duck-typed like ``kvloop.core.request.Request``).

    Returns a JSON-ready dict: counts ``completed``, ``aborted``, ``failed`` (and
    ``unfinished``, requests not yet finished, which are ignored), ``duration`` (first arrival
    of any request to last completion), ``input_tokens``, ``output_tokens``,
    ``request_throughput``, ``output_throughput``, ``total_token_throughput`` and ``goodput``
    (per second; None when no time passed), ``preemptions`` and ``recomputed_tokens`` over
    completed requests, ``slo_ttft``/``slo_tpot`` as given, and one dict per name in
    ``LATENCY_METRICS`` with ``count``, ``mean``, ``p50``, ``p90``, ``p99`` (None when empty).
    Goodput counts completed requests whose TTFT <= ``slo_ttft`` and TPOT <= ``slo_tpot``
    (SLOs given as None are ignored; a one-token request meets any TPOT SLO); with no SLO it
    equals the request throughput.
    """
    counts = {"completed": 0, "aborted": 0, "failed": 0, "unfinished": 0}
    ttft: list[float] = []
    tpot: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    queue: list[float] = []
    first_arrival = math.inf
    last_done = -math.inf
    input_tokens = output_tokens = preemptions = recomputed = good = 0
    sub = operator.sub
    for req in requests:
        first_arrival = min(first_arrival, req.arrival_time)
        name = _status_name(req)
        if name not in _COMPLETED:
            key = "aborted" if name == _ABORTED else "failed" if name == _FAILED else "unfinished"
            counts[key] += 1
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
            itl.extend(map(sub, times[1:], times))  # map stops at the shorter
        if (slo_ttft is None or t_ttft <= slo_ttft) and (
            slo_tpot is None or t_tpot is None or t_tpot <= slo_tpot
        ):
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
    for key, values in zip(LATENCY_METRICS, (ttft, tpot, itl, e2e, queue), strict=True):
        summary[key] = _stats(values)
    return summary


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


def format_table(summary: dict[str, Any], extra: dict[str, Any] | None = None) -> str:
    """Render a summary as a terminal table like vLLM's benchmark_serving (latencies in ms).

    A ``load`` entry (``kvloop.sim.load.load_summary``) adds a Load section: arrival rate
    and utilisation. ``extra`` key/values (e.g. scheduler stats: preemptions, prefix hit
    rate, KV usage) are appended in their own section, printed as given (floats with 4
    decimals).
    """
    lines = [f"{' Serving Benchmark Result ':=^{_WIDTH}}"]

    def row(label: str, value: Any, digits: int = 2) -> None:
        lines.append(f"{label + ':':<40}{_fmt(value, digits):>10}")

    row("Successful requests", summary.get("completed"))
    for key, label in (("aborted", "Aborted requests"), ("failed", "Failed requests")):
        if summary.get(key):
            row(label, summary[key])
    row("Duration (s)", summary.get("duration"))
    row("Total input tokens", summary.get("input_tokens"))
    row("Total generated tokens", summary.get("output_tokens"))
    row("Request throughput (req/s)", summary.get("request_throughput"))
    if summary.get("slo_ttft") is not None or summary.get("slo_tpot") is not None:
        row("Request goodput (req/s)", summary.get("goodput"))
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
    if summary.get("load"):
        lines.append(f"{' Load ':-^{_WIDTH}}")
        for key, value in load_rows(summary["load"]).items():
            row(key, value)
    if extra:
        lines.append(f"{' Scheduler ':-^{_WIDTH}}")
        for key, value in extra.items():
            row(str(key), value, 4)
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


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
