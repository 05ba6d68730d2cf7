"""Each load stage of a staged workload on its own: latency, throughput and an overload verdict.

An inference-perf benchmark (``kvloop.sim.inference_perf``) reports every stage apart: a
sweep of rates in one run. A request belongs to the stage it arrived in, whenever it
finishes. Per stage, over its completed requests (with ARCHITECTURE.md's meanings):

- ``ttft_mean``/``ttft_p50``/``ttft_p90`` and ``e2e_mean``/``e2e_p50`` (seconds,
  nearest-rank percentiles);
- ``decode_per_token``: (e2e mean − TTFT mean) / (median output length − 1), the decode
  time per token inference-perf's summaries allow (None when the median output is one token);
- ``output_throughput``: the stage's output tokens per second from its first arrival to its
  last completion;
- ``overloaded``: the stage's queue grows without bound: the requests arriving in its last
  tenth wait (TTFT) more than :data:`OVERLOAD_WAIT_S` longer on average than those of its
  first tenth (tenths by count, in arrival order, at least one request each).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from kvloop.sim.inference_perf import Stage, StagedWorkload
from kvloop.sim.metrics import percentile

__all__ = ["OVERLOAD_WAIT_S", "format_stages", "stage_summaries", "stage_summary"]

OVERLOAD_WAIT_S = 10.0
"""Extra wait (seconds of mean TTFT, last tenth of a stage's arrivals over its first tenth)
that marks the stage overloaded."""

_COMPLETED = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH"})


def _completed(req: Any) -> bool:
    status = req.status
    return str(getattr(status, "name", status)) in _COMPLETED


def _times(req: Any) -> tuple[float, float]:
    """(first token, last token) times of a completed request."""
    times = req.token_times
    first = req.first_token_time if req.first_token_time is not None else times[0]
    last = times[-1] if times else req.finished_time
    return first, last


def stage_summary(stage: Stage, requests: Sequence[Any], *,
                  output_len: float | None = None) -> dict[str, Any]:
    """The figures of one stage (see the module docstring), JSON-ready, in seconds.

    ``requests`` are the stage's requests (duck-typed like ``kvloop.core.request.Request``),
    finished or not; ``output_len`` replaces the median output length of its completed
    requests in ``decode_per_token`` (a measured run's, to compare like with like). Keys:
    ``rate``, ``start_s``, ``duration_s``, ``requests``, ``completed``, the latencies,
    ``output_len_median``, ``decode_per_token``, ``output_tokens``, ``output_throughput``,
    ``ttft_growth`` (the last tenth's mean TTFT minus the first tenth's) and ``overloaded``;
    the figures are None when no request of the stage completed.
    """
    done = sorted((r for r in requests if _completed(r)), key=lambda r: r.arrival_time)
    row: dict[str, Any] = {"rate": stage.rate, "start_s": stage.start_s,
                           "duration_s": stage.duration_s, "requests": len(requests),
                           "completed": len(done)}
    keys = ("ttft_mean", "ttft_p50", "ttft_p90", "e2e_mean", "e2e_p50", "output_len_median",
            "decode_per_token", "output_tokens", "output_throughput", "ttft_growth",
            "overloaded")
    if not done:
        return row | dict.fromkeys(keys)
    spans = [_times(r) for r in done]
    ttft = [first - r.arrival_time for r, (first, _) in zip(done, spans, strict=True)]
    e2e = [last - r.arrival_time for r, (_, last) in zip(done, spans, strict=True)]
    outs = sorted(len(r.output_token_ids) for r in done)
    median = percentile(outs, 50) if output_len is None else output_len
    ttft_mean, e2e_mean = statistics.fmean(ttft), statistics.fmean(e2e)
    tenth = max(1, len(done) // 10)
    # NOTE: `done` is in arrival order, so these tenths are the stage's earliest and latest.
    growth = statistics.fmean(ttft[-tenth:]) - statistics.fmean(ttft[:tenth])
    span = max(last for _, last in spans) - done[0].arrival_time
    tokens = sum(outs)
    sorted_ttft, sorted_e2e = sorted(ttft), sorted(e2e)
    return row | {
        "ttft_mean": ttft_mean,
        "ttft_p50": percentile(sorted_ttft, 50),
        "ttft_p90": percentile(sorted_ttft, 90),
        "e2e_mean": e2e_mean,
        "e2e_p50": percentile(sorted_e2e, 50),
        "output_len_median": median,
        "decode_per_token": (e2e_mean - ttft_mean) / (median - 1) if median > 1 else None,
        "output_tokens": tokens,
        "output_throughput": tokens / span if span > 0 else None,
        "ttft_growth": growth,
        "overloaded": growth > OVERLOAD_WAIT_S,
    }


def stage_summaries(requests: Sequence[Any], workload: StagedWorkload) -> list[dict[str, Any]]:
    """:func:`stage_summary` of every stage of ``workload``, in order, over ``requests`` (the
    simulated requests of ``workload.requests``, matched by ``request_id``; requests of other
    ids are ignored)."""
    stage_by_id = {w.request_id: s for w, s in zip(workload.requests, workload.stage_of,
                                                   strict=True)}
    groups: list[list[Any]] = [[] for _ in workload.stages]
    for req in requests:
        k = stage_by_id.get(req.request_id)
        if k is not None:
            groups[k].append(req)
    return [stage_summary(stage, group) for stage, group in zip(workload.stages, groups,
                                                                strict=True)]


def format_stages(rows: Sequence[dict[str, Any]]) -> str:
    """A terminal table with one line per stage (TTFT and decode per token in ms, e2e in s)."""
    head = (f"{'Stage':>5}{'Rate/s':>8}{'Dur s':>7}{'Reqs':>6}{'Done':>6}"
            f"{'TTFT ms':>9}{'p50':>8}{'p90':>8}{'E2E s':>8}{'p50':>7}"
            f"{'Dec ms/tok':>11}{'Out tok/s':>10}  Overloaded")
    width = len(head)
    lines = [f"{' Stages ':=^{width}}", head]

    def num(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
        return "-" if value is None else f"{value * scale:.{digits}f}"

    for i, r in enumerate(rows):
        verdict = "-" if r["overloaded"] is None else ("yes" if r["overloaded"] else "no")
        lines.append(
            f"{i:>5}{r['rate']:>8.4g}{r['duration_s']:>7.4g}{r['requests']:>6}"
            f"{r['completed']:>6}{num(r['ttft_mean'], 1e3):>9}{num(r['ttft_p50'], 1e3):>8}"
            f"{num(r['ttft_p90'], 1e3):>8}{num(r['e2e_mean'], digits=2):>8}"
            f"{num(r['e2e_p50'], digits=2):>7}{num(r['decode_per_token'], 1e3, 2):>11}"
            f"{num(r['output_throughput']):>10}  {verdict}"
        )
    lines.append("=" * width)
    return "\n".join(lines)
