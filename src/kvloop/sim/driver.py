"""Discrete-event simulation: the real scheduler on a virtual clock with a cost model.

Arrivals enter at their times, each step advances the clock by the predicted step time,
and idle gaps are skipped. Each step is ``kvloop.core.loop.run_step`` with the scheduler the
engine serves with, so the simulation runs the engine's loop, not a copy of it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core.interface import ModelRunnerOutput, SchedulerOutput
from kvloop.core.loop import run_step
from kvloop.core.request import Request
from kvloop.core.scheduler import Scheduler
from kvloop.core.stats import StepRecorder
from kvloop.executor.simulated.cost_model import CostModel
from kvloop.executor.simulated.executor import SimulatedExecutor
from kvloop.sampling_params import SamplingParams
from kvloop.sim.load import load_summary
from kvloop.sim.metrics import summarize_requests
from kvloop.sim.traces import WorkloadRequest


class VirtualClock:
    """Simulated time in seconds; the scheduler reads it through ``__call__``."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def _ran(out: SchedulerOutput) -> bool:
    """Whether a step did any work (tokens or swap-outs); an empty step takes no time."""
    return out.total_num_scheduled_tokens > 0 or bool(out.blocks_to_swap_out)


class _ClockedExecutor:
    """The simulated executor on a virtual clock: a step that ran advances the clock by its
    predicted time before the scheduler applies its results, so tokens carry the step's end."""

    def __init__(self, executor: SimulatedExecutor, clock: VirtualClock) -> None:
        self.executor = executor
        self.clock = clock
        self.busy_s = 0.0
        """Virtual seconds spent in steps (the engine's busy time)."""

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        result = self.executor.execute(scheduler_output)
        if _ran(scheduler_output):
            self.clock.now += result.step_time_s
            self.busy_s += result.step_time_s
        return result


@dataclass
class SimulationResult:
    """What a simulation produced: finished requests, scheduler totals and metrics."""

    requests: list[Request]
    scheduler: Scheduler
    metrics: dict[str, Any]
    """Request-level metrics (``summarize_requests``) plus ``scheduler`` totals and ``load``
    (``kvloop.sim.load.load_summary``: arrival rate, utilisation, overload)."""
    wall_time_s: float
    """Real seconds the simulation took."""
    records: list = field(default_factory=list)


def scheduler_summary(scheduler: Scheduler) -> dict[str, Any]:
    """Scheduler-level totals in the shape of the metrics JSON."""
    st, kv = scheduler.stats, scheduler.kv
    return {
        "num_steps": st.num_steps,
        "num_preemptions": st.num_preemptions,
        "num_recompute_preemptions": st.num_recompute_preemptions,
        "num_swap_preemptions": st.num_swap_preemptions,
        "recomputed_tokens": st.num_recomputed_tokens,
        "swapped_out_blocks": st.num_blocks_swapped_out,
        "swapped_in_blocks": st.num_blocks_swapped_in,
        "prefix_cache_queries": st.prefix_cache_queries,
        "prefix_cache_hits": st.prefix_cache_hits,
        "prefix_cache_hit_rate": (st.prefix_cache_hits / st.prefix_cache_queries
                                  if st.prefix_cache_queries else 0.0),
        "recompute_prefix_hits": st.recompute_prefix_hits,
        "kv_usage_mean": st.kv_usage_mean,
        "kv_usage_peak": st.kv_usage_peak,
        "num_gpu_blocks": kv.num_gpu_blocks,
        "num_cpu_blocks": kv.num_cpu_blocks,
    }


def to_request(w: WorkloadRequest) -> Request:
    """A scheduler request that generates exactly ``w.output_len`` placeholder tokens."""
    return Request(
        w.request_id,
        w.prompt_token_ids,
        SamplingParams(max_tokens=w.output_len, ignore_eos=True),
        arrival_time=w.arrival_time,
        priority=w.priority,
        tenant=w.tenant,
    )


def simulate(
    workload: Sequence[WorkloadRequest],
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    cost_model: CostModel,
    *,
    recorder: StepRecorder | None = None,
    progress: bool = False,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
) -> SimulationResult:
    """Run ``workload`` through the scheduler and the simulated executor to completion.

    Goodput counts requests that met ``slo_ttft``/``slo_tpot``; when not given they are the
    scheduler's (``scheduler_config.slo_ttft``/``slo_tpot``), the targets the ``slo`` policy
    schedules for, so the policy and the metric judge by the same SLOs. Per-tenant service
    is weighted by ``scheduler_config.tenant_weights``.
    """
    if slo_ttft is None:
        slo_ttft = scheduler_config.slo_ttft
    if slo_tpot is None:
        slo_tpot = scheduler_config.slo_tpot
    started = time.perf_counter()
    clock = VirtualClock()
    scheduler = Scheduler(scheduler_config, cache_config, clock=clock, recorder=recorder)
    executor = _ClockedExecutor(SimulatedExecutor(cost_model, cache_config.block_size), clock)
    requests = sorted((to_request(w) for w in workload), key=lambda r: r.arrival_time)
    n = len(requests)
    i = 0
    bar = tqdm(total=n, disable=not progress, unit="req", mininterval=0.5, leave=False)
    while i < n or scheduler.requests:
        while i < n and requests[i].arrival_time <= clock.now:
            scheduler.add_request(requests[i])
            i += 1
        if not scheduler.requests:
            if i < n:
                clock.now = requests[i].arrival_time  # skip the idle gap
            continue
        unfinished = len(scheduler.requests)
        step = run_step(scheduler, executor)
        if step.error is not None:
            raise step.error  # a simulated step cannot fail: this is a bug, not a fault
        if progress:
            bar.update(unfinished - len(scheduler.requests))
        if not _ran(step.scheduler_output):
            # Nothing could run (e.g. everything waits on memory held by nobody): only
            # arrivals can change that, so jump to the next one.
            if i >= n:
                raise RuntimeError("simulation stalled with work left and no arrivals")
            clock.now = max(clock.now, requests[i].arrival_time)
    bar.close()
    metrics = summarize_requests(requests, slo_ttft=slo_ttft, slo_tpot=slo_tpot,
                                 tenant_weights=dict(scheduler_config.tenant_weights))
    metrics["scheduler"] = scheduler_summary(scheduler)
    metrics["load"] = load_summary(requests, executor.busy_s, metrics["duration"])
    wall = time.perf_counter() - started
    metrics["wall_time_s"] = wall
    return SimulationResult(
        requests=requests,
        scheduler=scheduler,
        metrics=metrics,
        wall_time_s=wall,
        records=recorder.records if recorder is not None else [],
    )
