"""Metrics as the scheduling papers define them, over finished requests.

- **SLO attainment** (DistServe, Zhong et al., OSDI 2024): the fraction of requests that
  met both their TTFT and TPOT targets, over every request that completed or was refused
  (rejected or failed: they count as missed); aborted and unfinished ones are left out.
  DistServe's *goodput* is then the highest arrival rate at which attainment is at least
  90% (``kvloop.sim.goodput.find_goodput`` searches for it).
- **Backlogged service gap** (VTC, Sheng et al., OSDI 2024): a tenant is *backlogged* while
  one of its requests waits for its first token (arrival to first token). The run is cut
  into windows of ``window_s`` seconds from the first arrival; in each window the tenants
  backlogged for all of it are compared by the service they received in it (prompt tokens
  x 1 + output tokens x 2 by default, divided by the tenant's weight). The gap of a window
  is the largest minus the smallest; the summary gives the max and mean over windows with
  at least two such tenants, and the mean of Jain's index over them. A prompt's service is
  spread evenly from its first scheduled time to its first token; each output token
  counts when it comes.
- **QoE** (Andes, Liu et al. 2024): a reader expects the first token after ``ttft`` and
  then one token every ``1 / tds`` seconds (the expected timeline ``e_k``). Tokens that
  come early wait for the reader; late ones stall them. QoE is the area under
  ``min(tokens delivered, tokens expected)`` over the area under the expected curve, both
  up to the expected end: ``sum(max(0, T - max(t_k, e_k))) / sum(T - e_k)``. 1 means every
  token came when the reader wanted it; a rejected or failed request has QoE 0.

NOTE: requests are duck-typed like ``kvloop.core.request.Request`` (the fields
``summarize_requests`` reads), so the engine's, the simulator's and a trace's requests all
work.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from typing import Any

from kvloop.sim.timeline import StepTimeline

__all__ = [
    "DEFAULT_TDS",
    "SERVICE_WEIGHTS",
    "WINDOW_S",
    "backlogged_intervals",
    "qoe",
    "qoe_summary",
    "slo_attainment",
    "vtc_gap",
]

SERVICE_WEIGHTS = (1.0, 2.0)
"""VTC's cost of service: (per prompt token, per output token)."""
WINDOW_S = 60.0
"""VTC's window for the backlogged service gap, seconds."""
DEFAULT_TTFT = 1.0
"""Expected TTFT for QoE when no TTFT target is given, seconds."""
DEFAULT_TDS = 5.0
"""Expected token delivery speed (a reading pace) for QoE when no TPOT target is given,
tokens per second."""

_COMPLETED = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH"})
_MISSED = frozenset({"FINISHED_REJECTED", "FINISHED_ERROR"})


def _status(req: Any) -> str:
    return str(getattr(req.status, "name", req.status))


def _first(req: Any) -> float:
    return req.first_token_time if req.first_token_time is not None else req.token_times[0]


def _target(req: Any, name: str, default: float | None) -> float | None:
    own = getattr(req, name, None)
    return own if own is not None else default


def slo_attainment(requests: Sequence[Any], slo_ttft: float | None,
                   slo_tpot: float | None) -> dict[str, Any]:
    """``both``, ``ttft`` and ``tpot``: the fraction of judged requests (completed, rejected
    or failed) that met both targets, the TTFT one, the TPOT one (None when no request is
    judged; a target given as None is met by all); ``judged``: how many."""
    judged = met = met_ttft = met_tpot = 0
    for req in requests:
        name = _status(req)
        if name in _MISSED:
            judged += 1
            continue
        if name not in _COMPLETED:
            continue
        judged += 1
        ttft = _first(req) - req.arrival_time
        n_out = len(req.output_token_ids)
        times = req.token_times
        last = times[-1] if times else req.finished_time
        t_ttft, t_tpot = _target(req, "slo_ttft", slo_ttft), _target(req, "slo_tpot", slo_tpot)
        ok_ttft = t_ttft is None or ttft <= t_ttft
        ok_tpot = t_tpot is None or n_out < 2 or (last - _first(req)) / (n_out - 1) <= t_tpot
        met_ttft += ok_ttft
        met_tpot += ok_tpot
        met += ok_ttft and ok_tpot
    frac = (lambda x: x / judged) if judged else (lambda x: None)
    return {"judged": judged, "both": frac(met), "ttft": frac(met_ttft),
            "tpot": frac(met_tpot)}


def qoe(token_times: Sequence[float], arrival: float, ttft: float, tds: float,
        pieces: Sequence[tuple[int, float]] | None = None) -> float:
    """Andes QoE of one request whose tokens came at ``token_times`` (see the module).

    ``pieces``, when known, cut the tokens into consecutive pieces: (token count, longest
    gap between consecutive tokens inside the piece) each; a piece whose tokens come at
    least at the reader's pace is then summed in closed form."""
    n = len(token_times)
    if n == 0:
        return 0.0
    step = 1.0 / tds
    base = arrival + ttft  # when the reader wants token 0; token k: base + k * step
    end = base + n * step  # the expected end: the last token read
    got = 0.0
    a = 0
    for count, longest in pieces or ((n, math.inf),):
        b = a + count
        if longest <= step:
            # NOTE: inside the piece a token's lateness against the expected timeline never
            # grows: its late tokens come first (up to ``m``), those read before the end
            # up to ``c``; the on-time ones add end - (base + k * step) each.
            m = a + bisect.bisect_left(range(a, b), True,
                                       key=lambda k: token_times[k] <= base + k * step)
            c = bisect.bisect_left(token_times, end, a, m)
            got += (c - a) * end - sum(token_times[a:c])
            got += (b - m) * (end - base) - step * (m + b - 1) * (b - m) / 2
        else:
            # NOTE: no max() calls (a simulation judges millions of tokens): the same sum.
            for k in range(a, b):
                t, e = token_times[k], base + k * step
                late = t if t > e else e
                if late < end:
                    got += end - late
        a = b
    # NOTE: the sum over k of (end - (base + k * step)) is step * (n + (n - 1) + ... + 1).
    return got / (step * n * (n + 1) / 2)


StepRuns = Mapping[str, tuple[StepTimeline, Sequence[tuple[int, int]]]]
"""Request id -> its replica's step timeline and its token times as runs of steps
(``StepTimeline.runs``), for requests where they are known."""


def qoe_summary(requests: Sequence[Any], slo_ttft: float | None, slo_tpot: float | None,
                runs: StepRuns | None = None) -> dict[str, Any]:
    """Mean and 10th percentile (nearest rank) of QoE over completed, rejected and failed
    requests; the expected TTFT and pace are each request's targets, else the given ones,
    else ``DEFAULT_TTFT`` and ``DEFAULT_TDS``. Also returns the defaults used. ``runs``
    lets a request's QoE be summed over runs of steps (``qoe``'s pieces)."""
    ttft_default = slo_ttft if slo_ttft is not None else DEFAULT_TTFT
    tds_default = 1.0 / slo_tpot if slo_tpot is not None else DEFAULT_TDS
    values: list[float] = []
    for req in requests:
        name = _status(req)
        if name in _MISSED:
            values.append(0.0)
        elif name in _COMPLETED:
            tpot = getattr(req, "slo_tpot", None)
            times = req.token_times or [_first(req)]
            values.append(qoe(times, req.arrival_time, _target(req, "slo_ttft", ttft_default),
                              1.0 / tpot if tpot is not None else tds_default,
                              _pieces(runs.get(req.request_id) if runs else None)))
    values.sort()
    return {
        "mean": sum(values) / len(values) if values else None,
        "p10": values[max(math.ceil(0.1 * len(values)), 1) - 1] if values else None,
        "expected_ttft": ttft_default,
        "expected_tds": tds_default,
    }


def _pieces(known: tuple[StepTimeline, Sequence[tuple[int, int]]] | None
            ) -> list[tuple[int, float]] | None:
    """``qoe``'s pieces of a request whose runs of steps are ``known``."""
    return None if known is None else known[0].pieces(known[1])


def backlogged_intervals(requests: Sequence[Any], end: float) -> dict[str, list[list[float]]]:
    """Tenant -> the merged, sorted intervals in which one of its requests waited for its
    first token (a request without one waits until ``end``)."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for req in requests:
        if _status(req) in _MISSED or _status(req) == "FINISHED_ABORTED":
            stop = req.finished_time if req.finished_time is not None else end
        else:
            stop = req.first_token_time if req.first_token_time is not None else end
        if stop > req.arrival_time:
            spans.setdefault(getattr(req, "tenant", "") or "", []).append(
                (req.arrival_time, stop))
    merged: dict[str, list[list[float]]] = {}
    for tenant, items in spans.items():
        items.sort()
        out: list[list[float]] = []
        for a, b in items:
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        merged[tenant] = out
    return merged


def _service_bins(requests: Sequence[Any], t0: float, window_s: float, n: int,
                  weights: tuple[float, float]) -> dict[str, list[float]]:
    """Tenant -> service units per window (prompt spread over its prefill, outputs as they
    come)."""
    w_in, w_out = weights
    bins: dict[str, list[float]] = {}
    for req in requests:
        if req.first_token_time is None:
            continue
        row = bins.setdefault(getattr(req, "tenant", "") or "", [0.0] * n)
        for t in req.token_times:
            row[min(int((t - t0) // window_s), n - 1)] += w_out
        start = getattr(req, "first_scheduled_time", None)
        stop = req.first_token_time
        prompt = w_in * req.num_prompt_tokens
        if start is None or stop <= start:
            row[min(int((stop - t0) // window_s), n - 1)] += prompt
            continue
        rate = prompt / (stop - start)
        i = min(int((start - t0) // window_s), n - 1)
        while True:
            edge = t0 + (i + 1) * window_s
            if stop <= edge or i == n - 1:
                row[i] += rate * (stop - max(start, t0 + i * window_s))
                break
            row[i] += rate * (edge - max(start, t0 + i * window_s))
            i += 1
    return bins


def _covers(intervals: list[list[float]], a: float, b: float) -> bool:
    """Whether one merged interval covers all of [a, b]."""
    return any(lo <= a and b <= hi for lo, hi in intervals)


def vtc_gap(requests: Sequence[Any], *, window_s: float = WINDOW_S,
            weights: tuple[float, float] = SERVICE_WEIGHTS,
            tenant_weights: dict[str, float] | None = None) -> dict[str, Any]:
    """VTC's backlogged service gap (see the module): ``max_gap``, ``mean_gap`` and
    ``jain_mean`` over ``windows`` (windows with two or more tenants backlogged throughout;
    None when there are none), ``window_s``, ``weights``; and ``tenants``: per tenant
    ``backlogged_s`` (time backlogged) and ``backlogged_rate`` (service units per second in
    the windows it was backlogged throughout, weighted; None when there were none)."""
    if not window_s > 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    if len(weights) != 2 or min(weights) < 0:
        raise ValueError(f"weights must be two numbers >= 0, got {weights}")
    done = [req for req in requests if req.first_token_time is not None]
    out: dict[str, Any] = {"window_s": window_s, "weights": list(weights), "windows": 0,
                           "max_gap": None, "mean_gap": None, "jain_mean": None,
                           "tenants": {}}
    if not done:
        return out
    tw = tenant_weights or {}
    t0 = min(req.arrival_time for req in requests)
    end = max(max(req.token_times) if req.token_times else req.first_token_time
              for req in done)
    n = max(1, math.ceil((end - t0) / window_s))
    bins = _service_bins(done, t0, window_s, n, weights)
    backlog = backlogged_intervals(requests, end)
    gaps: list[float] = []
    jains: list[float] = []
    in_windows: dict[str, list[float]] = {}
    for i in range(n):
        a, b = t0 + i * window_s, min(t0 + (i + 1) * window_s, end)
        if b - a < window_s / 2:
            continue  # NOTE: a short last window would judge a fraction of a window
        served = {t: bins.get(t, [0.0] * n)[i] / tw.get(t, 1.0)
                  for t, iv in backlog.items() if _covers(iv, a, b)}
        for t, x in served.items():
            in_windows.setdefault(t, []).append(x / (b - a))
        if len(served) < 2:
            continue
        xs = list(served.values())
        gaps.append(max(xs) - min(xs))
        square = sum(x * x for x in xs)
        jains.append(sum(xs) ** 2 / (len(xs) * square) if square > 0 else 1.0)
    if gaps:
        out.update(windows=len(gaps), max_gap=max(gaps), mean_gap=sum(gaps) / len(gaps),
                   jain_mean=sum(jains) / len(jains))
    out["tenants"] = {
        t: {"backlogged_s": sum(hi - lo for lo, hi in iv),
            "backlogged_rate": (sum(in_windows[t]) / len(in_windows[t])
                                if in_windows.get(t) else None)}
        for t, iv in backlog.items()
    }
    return out
