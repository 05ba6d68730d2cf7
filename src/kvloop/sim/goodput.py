"""DistServe's goodput: the highest arrival rate at which enough requests meet their SLOs.

``find_goodput`` bisects a rate range with a caller's run (rate -> SLO attainment), as
DistServe (Zhong et al., OSDI 2024) defines goodput: the most requests per second the
system takes with at least ``target`` (90%) of them meeting both the TTFT and the TPOT
target. NOTE: it assumes attainment falls as the rate grows (bisection); a run that is not
monotone gives one of the crossing points.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvloop.sim.traces import WorkloadRequest

__all__ = ["ATTAINMENT_TARGET", "GoodputSearch", "find_goodput", "parse_rate_range",
           "rescale_arrivals"]

ATTAINMENT_TARGET = 0.9
"""DistServe's share of requests that must meet both SLOs."""


@dataclass
class GoodputSearch:
    """The outcome of a rate search."""

    goodput: float | None
    """The highest rate found with attainment >= the target (None: not even ``lo``)."""
    bound: str
    """``found`` (inside the range), ``below`` (``lo`` already misses) or ``above`` (``hi``
    still meets it: the goodput is at least ``hi``)."""
    target: float
    probes: list[tuple[float, float]] = field(default_factory=list)
    """(rate, attainment) of every run, in the order run."""


def parse_rate_range(text: str) -> tuple[float, float]:
    """``LO:HI`` requests per second, 0 < LO < HI; ValueError naming what is wrong."""
    lo_s, sep, hi_s = text.partition(":")
    try:
        lo, hi = float(lo_s), float(hi_s)
    except ValueError:
        lo = hi = math.nan
    if not sep or not (0 < lo < hi < 1e9):
        raise ValueError(f"--find-goodput expects LO:HI requests/s with 0 < LO < HI, "
                         f"got {text!r}")
    return lo, hi


def find_goodput(attainment_at: Callable[[float], float], lo: float, hi: float, *,
                 target: float = ATTAINMENT_TARGET, rel_tol: float = 0.02,
                 max_runs: int = 14) -> GoodputSearch:
    """Bisect [``lo``, ``hi``] for the highest rate whose attainment is >= ``target``,
    until the bracket is within ``rel_tol`` of its top or ``max_runs`` runs were made."""
    if not 0 < lo < hi:
        raise ValueError(f"rate range must have 0 < lo < hi, got {lo}, {hi}")
    out = GoodputSearch(None, "found", target)

    def ok(rate: float) -> bool:
        a = attainment_at(rate)
        out.probes.append((rate, a))
        return a >= target

    if not ok(lo):
        out.bound = "below"
        return out
    if ok(hi):
        out.goodput, out.bound = hi, "above"
        return out
    good, bad = lo, hi
    while (bad - good) > rel_tol * bad and len(out.probes) < max_runs:
        mid = (good + bad) / 2
        if ok(mid):
            good = mid
        else:
            bad = mid
    out.goodput = good
    return out


def rescale_arrivals(workload: list[WorkloadRequest], rate: float, seed: int = 0
                     ) -> list[WorkloadRequest]:
    """The workload arriving at ``rate`` requests/s on average: its arrival gaps scaled
    (burstiness kept), or, when all arrive at once, Poisson arrivals seeded by ``seed``."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if not workload:
        return []
    times = [w.arrival_time for w in workload]
    t0, span = min(times), max(times) - min(times)
    if span > 0 and len(workload) > 1:
        factor = span / (len(workload) - 1) * rate  # the native rate over the new one
        return [replace(w, arrival_time=(w.arrival_time - t0) / factor) for w in workload]
    rng = random.Random(seed)
    t, out = 0.0, []
    for w in workload:
        out.append(replace(w, arrival_time=t))
        t += rng.expovariate(rate)
    return out
