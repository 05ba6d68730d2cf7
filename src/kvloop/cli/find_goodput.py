"""``kvloop simulate --find-goodput LO:HI``: DistServe's goodput by a rate search."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.sim.driver import simulate
from kvloop.sim.goodput import find_goodput, parse_rate_range, rescale_arrivals
from kvloop.sim.traces import WorkloadRequest


def rate_range(text: str) -> tuple[float, float]:
    """argparse type for ``LO:HI``."""
    try:
        return parse_rate_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run_find_goodput(args: argparse.Namespace, workload: list[WorkloadRequest],
                     sched: SchedulerConfig, cache: CacheConfig, cost: Any) -> int:
    """Search ``args.find_goodput`` for the highest rate at which 90% of the workload's
    requests meet both SLOs; print each run and the result (and ``--json``)."""
    if sched.slo_ttft is None and sched.slo_tpot is None:
        raise ValueError("--find-goodput needs an SLO: set --slo-ttft, --slo-tpot or both "
                         "(a request counts when it meets every SLO given)")
    if max(args.replicas, args.data_parallel_size) > 1:
        raise ValueError("--find-goodput searches one replica: not with --replicas or "
                         "--data-parallel-size > 1")
    lo, hi = args.find_goodput
    runs: list[dict[str, Any]] = []

    def attainment_at(rate: float) -> float:
        m = simulate(rescale_arrivals(workload, rate, args.seed), sched, cache, cost).metrics
        att = m["slo_attainment"]["both"] or 0.0
        runs.append({"rate": rate, "attainment": att, "ttft_p99": m["ttft"]["p99"],
                     "tpot_p99": m["tpot"]["p99"], "qoe_mean": m["qoe"]["mean"]})
        print(f"  rate {rate:9.3f} req/s: SLO attainment {100 * att:5.1f}%, "
              f"TTFT p99 {_ms(m['ttft']['p99'])} ms, TPOT p99 {_ms(m['tpot']['p99'])} ms",
              flush=True)
        return att

    print(f"kvloop simulate --find-goodput {lo:g}:{hi:g}: {len(workload)} requests, policy "
          f"{sched.policy}, SLOs TTFT {sched.slo_ttft} s, TPOT {sched.slo_tpot} s")
    found = find_goodput(attainment_at, lo, hi)
    if found.bound == "below":
        line = f"DistServe goodput: below {lo:g} req/s (90% attainment missed at {lo:g})"
    elif found.bound == "above":
        line = f"DistServe goodput: at least {hi:g} req/s (90% attainment met at {hi:g})"
    else:
        line = f"DistServe goodput: {found.goodput:.3f} req/s (highest rate with >= 90% " \
               "of requests meeting both SLOs)"
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"goodput": found.goodput, "bound": found.bound, "target": found.target,
                       "range": [lo, hi], "policy": sched.policy, "slo_ttft": sched.slo_ttft,
                       "slo_tpot": sched.slo_tpot, "runs": runs}, f, indent=2)
    return 0


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"
