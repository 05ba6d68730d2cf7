"""Cluster simulation: N replicas behind a router, on one virtual timeline.

Each replica is the engine's scheduler with a simulated executor (the same cost model for
all), driven by the one event loop of ``kvloop.sim.driver`` (``run_replicas``). An arrival is
routed by the very router objects the Ray Serve deployment uses (``kvloop.cluster.routers``):
``route_request`` on its prompt with the cache block size, and each replica's load at that
instant (queued, running, KV usage). With one replica the run is ``simulate``'s exactly.

Metrics: the usual summary over all requests, plus ``replicas`` (one row per replica:
requests, prefix hits, busy time, TTFT p50/p99, preemptions) and ``cluster`` (router,
replica count, prefix hit rate over the cluster, load imbalance = max/mean busy time).
The terminal summary is ``kvloop.sim.cluster_table``'s (re-exported here).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvloop.cluster.routers import ReplicaLoad, Router, make_router, route_request
from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core.request import Request
from kvloop.executor.simulated.cost_model import CostModel
from kvloop.sim.cluster_table import format_cluster, format_replicas
from kvloop.sim.driver import (
    Replica,
    SimulationResult,
    run_metrics,
    run_replicas,
    timelines,
    to_requests,
)
from kvloop.sim.metrics import summarize_requests
from kvloop.sim.traces import WorkloadRequest

__all__ = ["format_cluster", "format_replicas", "replica_names", "simulate_cluster"]


def replica_names(num_replicas: int) -> list[str]:
    """Replica ids ``r0``, ``r1``, ... zero-padded so that their sorted order is their
    numeric order (round-robin walks them in that order)."""
    width = len(str(num_replicas - 1))
    return [f"r{i:0{width}d}" for i in range(num_replicas)]


class _Routing:
    """Routes each arrival with a ``Router`` over the replicas' loads at that instant."""

    def __init__(self, router: Router, replicas: Sequence[Replica], block_size: int) -> None:
        self.router = router
        self.replicas = replicas
        self.block_size = block_size
        self.index = {rep.name: k for k, rep in enumerate(replicas)}

    def __call__(self, request: Request) -> int:
        # NOTE: O(replicas + routed blocks) per arrival, never O(requests so far).
        loads = {rep.name: ReplicaLoad(*rep.load()) for rep in self.replicas}
        routed = route_request(request.request_id, request.prompt_token_ids, self.block_size,
                               request.cache_salt)
        return self.index[self.router.choose(routed, loads)]


def simulate_cluster(
    workload: Sequence[WorkloadRequest],
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    cost_model: CostModel,
    *,
    num_replicas: int = 1,
    router: str | Router = "round-robin",
    progress: bool = False,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
) -> SimulationResult:
    """Run ``workload`` on ``num_replicas`` replicas of one configuration behind ``router``
    (a name in ``kvloop.cluster.routers.ROUTERS`` or a router object) to completion.

    A router given by name is made fresh; ``kv-aware`` indexes about as many blocks per
    replica as its KV cache holds (``cache_config.num_gpu_blocks``). SLOs default to the
    scheduler's, as in ``simulate``. The metrics are ``simulate``'s over all requests
    (``scheduler`` totals summed over replicas, ``load`` with a replica's mean busy time),
    plus ``replicas`` and ``cluster`` (see the module docstring).
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if isinstance(router, str):
        router = make_router(router, cache_blocks=cache_config.num_gpu_blocks)
    if slo_ttft is None:
        slo_ttft = scheduler_config.slo_ttft
    if slo_tpot is None:
        slo_tpot = scheduler_config.slo_tpot
    started = time.perf_counter()
    replicas = [Replica(name, scheduler_config, cache_config, cost_model)
                for name in replica_names(num_replicas)]
    requests = to_requests(workload)
    route = _Routing(router, replicas, cache_config.block_size)
    run_replicas(requests, replicas, route, progress=progress)
    metrics = run_metrics(requests, replicas, scheduler_config, slo_ttft, slo_tpot)
    metrics["replicas"] = [_replica_row(rep, slo_ttft, slo_tpot) for rep in replicas]
    metrics["cluster"] = _cluster_row(router.name, metrics)
    wall = time.perf_counter() - started
    metrics["wall_time_s"] = wall
    return SimulationResult(requests=requests, scheduler=replicas[0].scheduler, metrics=metrics,
                            wall_time_s=wall, replicas=replicas)


def _replica_row(rep: Replica, slo_ttft: float | None, slo_tpot: float | None) -> dict[str, Any]:
    """One replica's row of the ``replicas`` metrics (times in seconds)."""
    summary = summarize_requests(rep.requests, slo_ttft=slo_ttft, slo_tpot=slo_tpot,
                                 timelines=timelines([rep]))
    st = rep.scheduler.stats
    queries, hits = st.prefix_cache_queries, st.prefix_cache_hits
    return {
        "replica": rep.name,
        "requests": len(rep.requests),
        "completed": summary["completed"],
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "busy_time": rep.executor.busy_s,
        "ttft_p50": summary["ttft"]["p50"],
        "ttft_p99": summary["ttft"]["p99"],
        "preemptions": st.num_preemptions,
        "num_steps": st.num_steps,
    }


def _cluster_row(router: str, metrics: dict[str, Any]) -> dict[str, Any]:
    """The ``cluster`` metrics: hit rate over the cluster (hits and queries summed over
    replicas) and load imbalance, max/mean of the replicas' busy times (1 = even; None when
    nothing ran)."""
    busy = [row["busy_time"] for row in metrics["replicas"]]
    mean = sum(busy) / len(busy)
    return {
        "router": router,
        "num_replicas": len(busy),
        "prefix_cache_hit_rate": metrics["scheduler"]["prefix_cache_hit_rate"],
        "imbalance": max(busy) / mean if mean > 0 else None,
    }
