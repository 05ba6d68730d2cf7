"""Discrete-event simulation: the real scheduler on a virtual clock with a cost model.

Arrivals enter at their times, each step advances the clock by the predicted step time,
and idle gaps are skipped. Each step is ``kvloop.core.loop.run_step`` with the scheduler the
engine serves with, so the simulation runs the engine's loop, not a copy of it.

One event loop (:func:`run_replicas`) drives any number of replicas, each a scheduler and a
simulated executor on its own clock; :func:`simulate` is its one-replica case and
``kvloop.sim.cluster.simulate_cluster`` routes arrivals across many.
"""

from __future__ import annotations

import functools
import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core.interface import ModelRunnerOutput, SchedulerOutput
from kvloop.core.loop import run_step
from kvloop.core.request import Request
from kvloop.core.scheduler import Scheduler
from kvloop.core.stats import StepRecorder
from kvloop.executor.simulated.executor import PLACEHOLDER_TOKEN, SimulatedExecutor, StepCost
from kvloop.sampling_params import SamplingParams
from kvloop.sim.load import load_summary
from kvloop.sim.metrics import summarize_requests
from kvloop.sim.timeline import StepTimeline
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
        self.step_ends: list[float] = []
        """The clock at the end of every step that ran: each token's time is one."""

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        result = self.executor.execute(scheduler_output)
        if _ran(scheduler_output):
            self.clock.now += result.step_time_s
            self.busy_s += result.step_time_s
            self.step_ends.append(self.clock.now)
        return result

    def run(self, num_decodes: int, decode_context: int, chunks: list[tuple[int, int]]) -> None:
        """``execute`` for a step given as the simulated executor sees it (fast-forward),
        with at least one token."""
        step_time = self.executor.step_time(num_decodes, decode_context, chunks)
        self.clock.now += step_time
        self.busy_s += step_time
        self.step_ends.append(self.clock.now)


class Replica:
    """One simulated engine: a scheduler and a clocked simulated executor on its own clock.

    It is also the executor ``run_step`` is given, so it sees the scheduler between
    ``schedule()`` and ``update_from_output()`` and keeps the load of that moment: the load
    the replica shows while the step is in flight.
    """

    def __init__(self, name: str, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 cost_model: StepCost, recorder: StepRecorder | None = None, *,
                 fast_forward: bool = True) -> None:
        self.name = name
        """The replica's id (what a router ranks)."""
        self.clock = VirtualClock()
        """The replica's time: its last step's end, or the arrival that woke it."""
        self.scheduler = Scheduler(scheduler_config, cache_config, clock=self.clock,
                                   recorder=recorder)
        self.executor = _ClockedExecutor(
            SimulatedExecutor(cost_model, cache_config.block_size), self.clock)
        self.requests: list[Request] = []
        """Every request routed here, in arrival order."""
        self.pending: list[Request] = []
        """Requests routed here while a step was in flight: they join its next step, or the
        one after under an engine that schedules a step ahead (``lookahead``).
        NOTE: empty whenever ``busy`` is False."""
        self.held: list[Request] = []
        """Requests that came during the step before the one in flight, waiting out the step
        an engine scheduling ahead had already decided when they came."""
        overhead = getattr(cost_model, "overhead", None)
        self.frontend_s = float(getattr(overhead, "frontend_s", 0.0))
        """Seconds between a request's sending and the engine seeing it
        (``EngineOverhead.frontend_s``)."""
        self.lookahead = bool(getattr(overhead, "async_scheduling", False))
        """The engine schedules step N+1 while step N runs (vLLM's async scheduling): a
        request that comes during step N is first scheduled in step N+2."""
        self.busy = False
        """Whether a step is in flight (its end is on the event heap)."""
        self._in_flight: tuple[int, int, float] = (0, 0, 0.0)
        """(queued, running, KV usage) as the step in flight was scheduled."""
        self.fast_forward = fast_forward
        """Let the scheduler run the steps in which its running requests only decode in
        bulk (``Scheduler.fast_forward_decodes``): the same results, step for step."""

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Executor protocol: note the load as scheduled, then run the step on the clock."""
        self._in_flight = self._live_load()
        return self.executor.execute(scheduler_output)

    def fast_forward_steps(self, between: Callable[[], bool]) -> int:
        """Let the scheduler fast-forward from here (``between``: what happens at a step's
        end); how many steps it ran. Afterwards ``busy`` says whether its last step is in
        flight, or the run stopped at a step's end (``between`` handled it)."""
        return self.scheduler.fast_forward_decodes(self._run_step, between,
                                                   token_id=PLACEHOLDER_TOKEN)

    def _run_step(self, num_decodes: int, decode_context: int,
                  chunks: list[tuple[int, int]]) -> None:
        """``execute`` for a fast-forwarded step."""
        self._in_flight = self._live_load()
        self.busy = True
        self.executor.run(num_decodes, decode_context, chunks)

    def _live_load(self) -> tuple[int, int, float]:
        s = self.scheduler
        return len(s.waiting) + len(s.swapped), len(s.running), s.kv.usage

    def load(self) -> tuple[int, int, float]:
        """(queued, running, KV usage) now. Queued counts waiting, swapped-out and pending
        requests. While a step is in flight the scheduler already holds its results (the
        step ran at its start), so this is the load as the step was scheduled instead."""
        if not self.busy:
            return self._live_load()
        queued, running, usage = self._in_flight
        return queued + len(self.pending) + len(self.held), running, usage

    @functools.cached_property
    def timeline(self) -> StepTimeline:
        """The replica's step end times, read once its run is over (built once: the summary
        of the run and the replica's own row share it)."""
        return StepTimeline(self.executor.step_ends)

    def add(self, request: Request) -> None:
        """Route ``request`` here: into the scheduler now when idle, else at the step's end."""
        self.requests.append(request)
        if self.busy:
            self.pending.append(request)
        else:
            self.scheduler.add_request(request)


def run_replicas(requests: Sequence[Request], replicas: Sequence[Replica],
                 route: Callable[[Request], int], *, progress: bool = False) -> None:
    """Run ``requests`` (sorted by arrival) on ``replicas`` to completion on one timeline.

    The next event is the earliest of the next arrival and the end of each replica's step in
    flight (a heap); an arrival at the same time as a step end comes first. Each arrival goes
    to ``replicas[route(request)]``. A replica whose step ends takes the requests that came
    meanwhile and starts its next step at once; an idle one starts when its arrivals (all
    of those at that instant) are in. A step is one ``run_step``: scheduled at its start,
    tokens stamped at its end (the replica's clock), results held back from view until then.
    """
    ends: list[tuple[float, int]] = []
    """Heap of (step end, replica index) of the steps in flight."""
    n, i = len(requests), 0
    # NOTE: requests reach the engine the server's frontend time after they were sent (one
    # figure for all replicas: they run one engine); their arrival time stays the sending
    # time, which latencies are measured from.
    delay = replicas[0].frontend_s if replicas else 0.0
    solo = len(replicas) == 1
    bar = tqdm(total=n, disable=not progress, unit="req", mininterval=0.5, leave=False)

    def arrive() -> list[int]:
        """Route the requests arriving at the next arrival time; the replicas they woke."""
        nonlocal i
        now = requests[i].arrival_time + delay
        woken: list[int] = []
        while i < n and requests[i].arrival_time + delay <= now:
            k = route(requests[i])
            rep = replicas[k]
            if not rep.busy:
                rep.clock.now = max(rep.clock.now, now)  # skip the idle gap
                if k not in woken:
                    woken.append(k)
            rep.add(requests[i])
            i += 1
        return woken

    def step_ended(k: int) -> None:
        """Replica ``k``'s step in flight ended: the requests that came meanwhile join."""
        rep = replicas[k]
        rep.busy = False
        if not rep.held and not rep.pending:
            return  # NOTE: the common case in a fast-forward: nobody came
        joining = rep.held if rep.lookahead else rep.pending
        for req in joining:
            rep.scheduler.add_request(req)
        if rep.lookahead:
            rep.held = rep.pending
            rep.pending = []
        else:
            rep.pending.clear()

    def between(k: int) -> bool:
        """The end of fast-forwarding replica ``k``'s step, as this loop would handle it:
        first the arrivals up to it, then ``step_ended``. With other replicas, False (and
        nothing done) when an arrival comes first: it is routed on their loads then."""
        end = replicas[k].clock.now
        while i < n and requests[i].arrival_time + delay <= end:
            if not solo:
                return False
            arrive()  # NOTE: the one replica is busy: nothing is woken
        step_ended(k)
        return True

    def start(k: int, fast: bool = True) -> None:
        rep = replicas[k]
        sched = rep.scheduler
        if not sched.requests:
            return
        unfinished = len(sched.requests)
        if fast and rep.fast_forward and rep.fast_forward_steps(lambda: between(k)):
            if progress:
                bar.update(unfinished - len(sched.requests))
            if rep.busy:
                heapq.heappush(ends, (rep.clock.now, k))
            else:
                # NOTE: it stopped at a step's end (handled by ``between``): go on as the
                # loop goes on from there, with the next step run as usual.
                resume(k, fast=False)
            return
        step = run_step(sched, rep)
        if step.error is not None:
            raise step.error  # a simulated step cannot fail: this is a bug, not a fault
        if progress:
            bar.update(unfinished - len(sched.requests))
        # NOTE: a step that ran nothing (everything waits on memory held by nobody) leaves
        # the replica idle: only an arrival routed to it can change that.
        if _ran(step.scheduler_output):
            rep.busy = True
            heapq.heappush(ends, (rep.clock.now, k))

    def resume(k: int, fast: bool = True) -> None:
        """Replica ``k`` is at a step's end, its joiners in: start its next step."""
        rep = replicas[k]
        start(k, fast)
        if rep.lookahead and not rep.busy and rep.held:
            # NOTE: nothing ran, so no step was decided ahead: they join at once
            for req in rep.held:
                rep.scheduler.add_request(req)
            rep.held = []
            start(k)

    while i < n or ends:
        if i < n and (not ends or requests[i].arrival_time + delay <= ends[0][0]):
            for k in sorted(arrive()):
                start(k)
        else:
            _, k = heapq.heappop(ends)
            step_ended(k)
            resume(k)
    bar.close()
    if any(rep.scheduler.requests for rep in replicas):
        raise RuntimeError("simulation stalled with work left and no arrivals")


@dataclass
class SimulationResult:
    """What a simulation produced: finished requests, scheduler totals and metrics."""

    requests: list[Request]
    scheduler: Scheduler
    """The (first) replica's scheduler."""
    metrics: dict[str, Any]
    """Request-level metrics (``summarize_requests``) plus ``scheduler`` totals and ``load``
    (``kvloop.sim.load.load_summary``: arrival rate, utilisation, overload)."""
    wall_time_s: float
    """Real seconds the simulation took."""
    records: list = field(default_factory=list)
    replicas: list[Replica] = field(default_factory=list)
    """Every replica (one for ``simulate``)."""


_TOTALS: dict[str, Callable[[Scheduler], int | float]] = {
    "num_steps": lambda s: s.stats.num_steps,
    "num_preemptions": lambda s: s.stats.num_preemptions,
    "num_recompute_preemptions": lambda s: s.stats.num_recompute_preemptions,
    "num_swap_preemptions": lambda s: s.stats.num_swap_preemptions,
    "recomputed_tokens": lambda s: s.stats.num_recomputed_tokens,
    "swapped_out_blocks": lambda s: s.stats.num_blocks_swapped_out,
    "swapped_in_blocks": lambda s: s.stats.num_blocks_swapped_in,
    "prefix_cache_queries": lambda s: s.stats.prefix_cache_queries,
    "prefix_cache_hits": lambda s: s.stats.prefix_cache_hits,
    "recompute_prefix_hits": lambda s: s.stats.recompute_prefix_hits,
    "kv_usage_sum": lambda s: s.stats.kv_usage_sum,
    "num_gpu_blocks": lambda s: s.kv.num_gpu_blocks,
    "num_cpu_blocks": lambda s: s.kv.num_cpu_blocks,
}
"""Scheduler totals that add up over replicas."""


def scheduler_summary(*schedulers: Scheduler) -> dict[str, Any]:
    """Scheduler-level totals in the shape of the metrics JSON, over one scheduler or summed
    over several (block pools too); KV usage mean over all their steps, peak the highest."""
    t = {key: sum(get(s) for s in schedulers) for key, get in _TOTALS.items()}
    steps, queries = t["num_steps"], t["prefix_cache_queries"]
    out = {key: t[key] for key in list(_TOTALS)[:9]}
    out["prefix_cache_hit_rate"] = t["prefix_cache_hits"] / queries if queries else 0.0
    out["recompute_prefix_hits"] = t["recompute_prefix_hits"]
    out["kv_usage_mean"] = t["kv_usage_sum"] / steps if steps else 0.0
    out["kv_usage_peak"] = max(s.stats.kv_usage_peak for s in schedulers)
    out["num_gpu_blocks"], out["num_cpu_blocks"] = t["num_gpu_blocks"], t["num_cpu_blocks"]
    if any(not s.kv.plain_lru for s in schedulers):
        # NOTE: blocks (device hits counted at every admission, recomputes included)
        host = [vars(s.kv.host.stats) for s in schedulers]
        out["kv_offload"] = {key: sum(h[key] for h in host) for key in host[0]}
        out["kv_offload"]["protected_skips"] = sum(s.kv.pool.num_protected_skips
                                                   for s in schedulers)
    return out


def to_request(w: WorkloadRequest, params: SamplingParams | None = None) -> Request:
    """A scheduler request that generates exactly ``w.output_len`` placeholder tokens
    (``params``: those sampling parameters, made already)."""
    return Request(
        w.request_id,
        w.prompt_token_ids,
        params or SamplingParams(max_tokens=w.output_len, ignore_eos=True),
        arrival_time=w.arrival_time,
        priority=w.priority,
        tenant=w.tenant,
    )


def to_requests(workload: Sequence[WorkloadRequest]) -> list[Request]:
    """Scheduler requests of ``workload``, sorted by arrival (stable).

    NOTE: requests of one output length share one ``SamplingParams`` (nothing changes it
    once made): validating a fresh one per request took a tenth of a second in 16,800."""
    made: dict[int, SamplingParams] = {}

    def params(w: WorkloadRequest) -> SamplingParams:
        p = made.get(w.output_len)
        if p is None:
            p = made[w.output_len] = SamplingParams(max_tokens=w.output_len, ignore_eos=True)
        return p

    return sorted((to_request(w, params(w)) for w in workload), key=lambda r: r.arrival_time)


def timelines(replicas: Sequence[Replica]) -> dict[str, StepTimeline]:
    """Request id -> the step timeline of the replica that served it."""
    out: dict[str, StepTimeline] = {}
    for rep in replicas:
        out.update(dict.fromkeys((r.request_id for r in rep.requests), rep.timeline))
    return out


def run_metrics(requests: Sequence[Request], replicas: Sequence[Replica],
                scheduler_config: SchedulerConfig, slo_ttft: float | None,
                slo_tpot: float | None) -> dict[str, Any]:
    """The metrics of a finished run: ``summarize_requests`` over all requests, ``scheduler``
    totals over all replicas, and ``load`` with the mean busy time of a replica."""
    metrics = summarize_requests(requests, slo_ttft=slo_ttft, slo_tpot=slo_tpot,
                                 tenant_weights=dict(scheduler_config.tenant_weights),
                                 timelines=timelines(replicas))
    metrics["scheduler"] = scheduler_summary(*(rep.scheduler for rep in replicas))
    busy = sum(rep.executor.busy_s for rep in replicas) / len(replicas)
    metrics["load"] = load_summary(requests, busy, metrics["duration"])
    return metrics


def simulate(
    workload: Sequence[WorkloadRequest],
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    cost_model: StepCost,
    *,
    recorder: StepRecorder | None = None,
    progress: bool = False,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    fast_forward: bool = True,
) -> SimulationResult:
    """Run ``workload`` through the scheduler and the simulated executor to completion.

    Goodput counts requests that met ``slo_ttft``/``slo_tpot``; when not given they are the
    scheduler's (``scheduler_config.slo_ttft``/``slo_tpot``), the targets the ``slo`` policy
    schedules for, so the policy and the metric judge by the same SLOs. Per-tenant service
    is weighted by ``scheduler_config.tenant_weights``. ``fast_forward`` lets the scheduler
    run the steps in which its running requests only decode in bulk
    (``Scheduler.fast_forward_decodes``): the results are the same step for step, so
    turning it off is for checking that.
    """
    if slo_ttft is None:
        slo_ttft = scheduler_config.slo_ttft
    if slo_tpot is None:
        slo_tpot = scheduler_config.slo_tpot
    started = time.perf_counter()
    replica = Replica("r0", scheduler_config, cache_config, cost_model, recorder,
                      fast_forward=fast_forward)
    requests = to_requests(workload)
    run_replicas(requests, [replica], lambda _: 0, progress=progress)
    metrics = run_metrics(requests, [replica], scheduler_config, slo_ttft, slo_tpot)
    wall = time.perf_counter() - started
    metrics["wall_time_s"] = wall
    return SimulationResult(
        requests=requests,
        scheduler=replica.scheduler,
        metrics=metrics,
        wall_time_s=wall,
        records=recorder.records if recorder is not None else [],
        replicas=[replica],
    )
