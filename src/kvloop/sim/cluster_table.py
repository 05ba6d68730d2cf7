"""The terminal summary of a cluster simulation (``kvloop simulate --replicas N``).

The request lines (counts, throughput, latencies) are over every request of the cluster,
as for one engine. The Load and Scheduler lines mix figures of different kinds, so each
names its kind:

- ``total``: summed over the replicas (steps, preemptions, KV blocks, arrival rate);
- ``mean over replicas`` / ``max over replicas``: one replica's figure, averaged or the
  highest (engine busy time, KV usage);
- ``whole cluster``: one figure over the pooled counts or requests (prefix hit rate =
  summed hits / summed lookups; queue growth over all requests);
- ``max/mean``: the load imbalance, max/mean of the replicas' busy times.

A per-replica table follows, titled with the router.
"""

from __future__ import annotations

from typing import Any

from kvloop.sim.load import load_rows
from kvloop.sim.metrics import format_table

__all__ = ["cluster_load_rows", "cluster_scheduler_rows", "format_cluster", "format_replicas"]

_WIDTH = 50

_LOAD_LABELS = {  # load_rows' label -> the cluster's
    "Arrival rate (req/s)": "Arrival rate (req/s), total",
    "Engine busy (utilisation)": "Engine busy, mean over replicas",
    "Queue growth (s per s of arrivals)": "Queue growth (s per s), whole cluster",
}


def cluster_load_rows(load: dict[str, Any]) -> dict[str, str]:
    """The Load rows of a cluster run (``load_summary`` with a replica's mean busy time),
    each label saying how it aggregates the replicas."""
    return {_LOAD_LABELS[label]: value for label, value in load_rows(load).items()}


def cluster_scheduler_rows(metrics: dict[str, Any]) -> dict[str, Any]:
    """The Scheduler rows of a cluster run, from its ``scheduler`` totals (summed over the
    replicas by ``scheduler_summary``) and ``cluster`` entry; each label says whether it is
    a total, a mean or max over replicas, a whole-cluster rate or the max/mean ratio."""
    s, c = metrics["scheduler"], metrics["cluster"]
    cpu = s.get("num_cpu_blocks")
    imbalance = c["imbalance"]
    return {
        "Steps, total": s["num_steps"],
        "Preemptions (recompute / swap), total":
            f"{s['num_recompute_preemptions']} / {s['num_swap_preemptions']}",
        "Recomputed tokens, total": s["recomputed_tokens"],
        "Swapped blocks (out / in), total":
            f"{s['swapped_out_blocks']} / {s['swapped_in_blocks']}",
        "Prefix cache hit rate, whole cluster": f"{100 * s['prefix_cache_hit_rate']:.1f}%",
        # NOTE: scheduler_summary's mean is over every step of every replica
        "KV usage, mean over replicas": f"{100 * s['kv_usage_mean']:.1f}%",
        "KV usage peak, max over replicas": f"{100 * s['kv_usage_peak']:.1f}%",
        "KV blocks (device / host), total":
            f"{s['num_gpu_blocks']} / {'-' if cpu is None else cpu}",
        "Load imbalance, max/mean busy time": "-" if imbalance is None else f"{imbalance:.3f}",
    }


def format_cluster(metrics: dict[str, Any], wall_time_s: float) -> str:
    """The whole summary of a ``simulate_cluster`` run: the metrics table with labelled
    Load and Scheduler lines, then the per-replica table."""
    n = metrics["cluster"]["num_replicas"]
    extra = cluster_scheduler_rows(metrics) | {"Simulation wall time (s)": f"{wall_time_s:.2f}"}
    load = cluster_load_rows(metrics["load"]) if metrics.get("load") else None
    table = format_table(metrics, extra, title="Serving Benchmark Result: whole cluster",
                         load=load, extra_title=f"Scheduler: {n} replicas")
    return f"{table}\n{format_replicas(metrics)}"


def format_replicas(metrics: dict[str, Any], width: int = _WIDTH) -> str:
    """The per-replica table of a ``simulate_cluster`` run, titled with its router: requests,
    prefix hit rate, busy time, TTFT p50 / p99 and preemptions of each replica."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    router = metrics["cluster"]["router"]
    lines = [f"{f' per replica (router: {router}) ':-^{width}}",
             f"{'Replica':<7}{'Reqs':>6}{'Hit':>7}{'Busy s':>7}{'TTFT p50/p99 ms':>17}"
             f"{'Preem':>6}"]
    for row in metrics["replicas"]:
        ttft = f"{ms(row['ttft_p50'])} / {ms(row['ttft_p99'])}"
        lines.append(
            f"{row['replica']:<7}{row['requests']:>6}"
            f"{100 * row['prefix_cache_hit_rate']:>6.1f}%{row['busy_time']:>7.1f}"
            f"{ttft:>17}{row['preemptions']:>6}")
    if any(0 < row["requests"] < 100 for row in metrics["replicas"]):
        # NOTE: p99 of fewer than 100 requests is the slowest one: it can exceed the
        # cluster's p99, which is over all requests.
        lines.append("p99 of a replica with < 100 requests = its slowest")
    lines.append("=" * width)
    return "\n".join(lines)
