"""Was the offered load servable? Utilisation and an overload verdict for a finished run.

A batching engine is busy whenever a single request runs, so the busy fraction alone says
little about headroom; what marks overload is a queue that keeps growing. Under FCFS, when
arrivals come at rate λ and the configuration serves at most μ, a request arriving ``t``
seconds into the run waits about ``(λ/μ − 1)·t``: the slope of queue time against arrival
time *is* the excess ``λ/μ − 1``. :func:`load_summary` fits that slope by least squares
over the completed requests and calls the run overloaded when it is at least
:data:`MIN_EXCESS` (a stable queue has slope ≈ 0).

The arrival rate itself is only reported over at least :data:`MIN_RATE_ARRIVALS`
arrivals spanning at least :data:`MIN_RATE_SPAN_S`: two requests a millisecond apart have no
meaningful rate.

It gives no verdict when the arrivals span less than :data:`MIN_SPAN_SERVICES` median
service times (e2e − queue time) and the queue they built up (slope × span) is shorter
than one: a short burst that the engine absorbs is not overload. Nor when all requests
arrive at once (there is no arrival rate) or fewer than :data:`MIN_REQUESTS` complete.
Close to capacity the slope lags the truth (the first requests meet an empty engine), so
it is a lower bound there.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

__all__ = [
    "MIN_EXCESS", "MIN_RATE_ARRIVALS", "MIN_RATE_SPAN_S", "MIN_REQUESTS", "MIN_SPAN_SERVICES",
    "load_note", "load_rows", "load_summary",
]

MIN_EXCESS = 0.02
"""Smallest queue-time slope (seconds of queueing per second of arrivals) called overload."""
MIN_RATE_ARRIVALS = 5
"""Fewer arrivals than this report no arrival rate."""
MIN_RATE_SPAN_S = 1.0
"""Arrivals spanning less than this many seconds report no arrival rate."""
MIN_REQUESTS = 10
"""Fewer completed requests than this give no verdict."""
MIN_SPAN_SERVICES = 2.0
"""Arrivals spanning fewer median service times than this give no verdict."""

_COMPLETED = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH"})


def _slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def load_summary(requests: Iterable[Any], busy_time: float, duration: float) -> dict[str, Any]:
    """The load of a run, JSON-ready (seconds, requests per second).

    ``requests`` are duck-typed like ``kvloop.core.request.Request`` (arrival, first
    scheduled, finished and token times, status); ``busy_time`` is the time the engine spent
    in steps; ``duration`` the summary's first arrival to last completion. Keys:
    ``num_requests``, ``arrival_span``, ``arrival_rate`` (None when all arrive at once, or
    over fewer than :data:`MIN_RATE_ARRIVALS` arrivals or :data:`MIN_RATE_SPAN_S`),
    ``busy_time``, ``utilisation`` (busy / duration), ``queue_growth`` (the slope above; None
    without a verdict), ``overloaded`` (bool or None), ``excess`` (λ/μ − 1 when overloaded)
    and ``service_rate`` (λ / (1 + excess) when overloaded).
    """
    arrivals: list[float] = []
    done_arrivals: list[float] = []
    queue: list[float] = []
    service: list[float] = []
    for req in requests:
        arrivals.append(req.arrival_time)
        status = str(getattr(req.status, "name", req.status))
        if status not in _COMPLETED or req.first_scheduled_time is None:
            continue
        times = req.token_times
        last = times[-1] if times else req.finished_time
        if last is None:
            continue
        q = req.first_scheduled_time - req.arrival_time
        done_arrivals.append(req.arrival_time)
        queue.append(q)
        service.append(last - req.arrival_time - q)
    n = len(arrivals)
    span = max(arrivals) - min(arrivals) if arrivals else 0.0
    rate = (n - 1) / span if n >= MIN_RATE_ARRIVALS and span >= MIN_RATE_SPAN_S else None
    out: dict[str, Any] = {
        "num_requests": n,
        "arrival_span": span,
        "arrival_rate": rate,
        "busy_time": busy_time,
        "utilisation": busy_time / duration if duration > 0 else None,
        "queue_growth": None,
        "overloaded": None,
        "excess": None,
        "service_rate": None,
    }
    if rate is None or len(queue) < MIN_REQUESTS:
        return out
    window = max(done_arrivals) - min(done_arrivals)
    growth = _slope(done_arrivals, queue)
    typical = statistics.median(service)
    if window < MIN_SPAN_SERVICES * typical and growth * window < typical:
        return out
    overloaded = growth >= MIN_EXCESS
    out.update(queue_growth=growth, overloaded=overloaded)
    if overloaded:
        out.update(excess=growth, service_rate=rate / (1.0 + growth))
    return out


def load_rows(load: dict[str, Any]) -> dict[str, str]:
    """The load rows of the metrics table."""
    rate, util, growth = load["arrival_rate"], load["utilisation"], load["queue_growth"]
    if rate is not None:
        shown = f"{rate:.2f}"
    elif load["arrival_span"] == 0:
        shown = "all at once"
    else:
        shown = (f"- ({load['num_requests']} arrivals over {load['arrival_span']:.3g} s: "
                 "too few for a rate)")
    return {
        "Arrival rate (req/s)": shown,
        "Engine busy (utilisation)": "-" if util is None else f"{100 * util:.1f}%",
        "Queue growth (s per s of arrivals)":
            "-" if growth is None else f"{round(growth, 3) + 0.0:.3f}",  # no "-0.000"
    }


def load_note(load: dict[str, Any]) -> str | None:
    """One line when the run was overloaded, else None."""
    if not load.get("overloaded"):
        return None
    return (
        f"overloaded: arrivals exceed service rate by {100 * load['excess']:.0f}% "
        f"({load['arrival_rate']:.2f} req/s offered, ~{load['service_rate']:.2f} req/s "
        f"served); queue time grows {load['queue_growth']:.2f} s per second of arrivals, so "
        "TTFT and e2e measure the backlog"
    )
