"""The simulator's loop against the engine's: given the step times a served run measured,
the simulation must reproduce that run request by request."""

import random
from dataclasses import replace

import pytest

from helpers import FakeClock
from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core import ModelRunnerOutput, Scheduler, SchedulerOutput, StepRecorder
from kvloop.core.stats import StepRecord
from kvloop.engine.llm_engine import LLMEngine
from kvloop.executor.simulated import CostModel, get_hardware_spec, get_model_spec
from kvloop.sampling_params import SamplingParams
from kvloop.sim.driver import simulate
from kvloop.sim.measured import MeasuredSteps, batch_key, record_key
from kvloop.sim.traces import WorkloadRequest
from kvloop.sim.workloads import synthetic_workload
from kvloop.viz.summary import reconstruct_requests

HOST_S = 2e-3
"""Most host time between two steps (the engine's bookkeeping, arrivals joining)."""


class _JitteryExecutor:
    """Samples token 7 for everyone; each step moves the clock by a time that grows with the
    step's tokens plus random jitter, as a real device on a noisy machine does."""

    def __init__(self, clock: FakeClock, seed: int) -> None:
        self.clock, self.rng = clock, random.Random(seed)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        dt = (0.01 + 2e-5 * out.total_num_scheduled_tokens) * self.rng.uniform(0.7, 1.4)
        self.clock.now += dt
        return ModelRunnerOutput(dict.fromkeys(out.num_scheduled_tokens, (7,)), dt)


def _serve(workload: list[WorkloadRequest], sched: SchedulerConfig, cache: CacheConfig,
           seed: int) -> tuple[list[StepRecord], set[int]]:
    """The engine's own loop on a virtual clock, requests joining between steps once their
    arrival time has passed (as ``benchmarks/sim_fidelity.py`` serves them in real time),
    with up to HOST_S of host time after every step. Returns the step records and the
    steps an idle wait followed."""
    clock, recorder = FakeClock(), StepRecorder()
    engine = LLMEngine(Scheduler(sched, cache, clock=clock, recorder=recorder),
                       _JitteryExecutor(clock, seed), clock=clock)
    host = random.Random(seed + 1)
    idle_after: set[int] = set()
    i = 0
    while i < len(workload) or engine.has_unfinished_requests():
        while i < len(workload) and workload[i].arrival_time <= clock.now:
            w = workload[i]
            engine.add_request(w.request_id, list(w.prompt_token_ids),
                               SamplingParams(max_tokens=w.output_len, ignore_eos=True),
                               arrival_time=w.arrival_time)
            i += 1
        if engine.has_unfinished_requests():
            engine.step()
            clock.now += host.uniform(0.0, HOST_S)
        else:
            if recorder.records:
                idle_after.add(recorder.records[-1].step)
            clock.now = workload[i].arrival_time
    return recorder.records, idle_after


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_simulation_with_the_measured_step_times_reproduces_the_served_run(preemption_mode):
    wl = synthetic_workload(60, request_rate=10.0, prompt_len="4:300", output_len="20:120",
                            seed=5)
    # NOTE: two bursts with an idle gap between them, and a KV pool small enough that
    # requests are preempted and come back.
    wl = wl[:30] + [replace(w, arrival_time=w.arrival_time + 60.0) for w in wl[30:]]
    sched = SchedulerConfig(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256,
                            preemption_mode=preemption_mode)
    cache = CacheConfig(block_size=16, num_gpu_blocks=30,
                        num_cpu_blocks=60 if preemption_mode == "swap" else 0)
    records, idle_after = _serve(wl, sched, cache, seed=1)
    served = reconstruct_requests(records)
    assert {mode for r in records for _, mode in r.preempted} == {preemption_mode}
    assert idle_after

    cost = MeasuredSteps(records, idle_after=idle_after)  # no fallback: every batch known
    recorder = StepRecorder()
    sim = simulate(wl, sched, cache, cost, recorder=recorder)
    ran = [r for r in records if r.scheduled or r.num_blocks_swapped_out]
    assert cost.misses == 0 and cost.hits == len(ran)
    # The same batches, started at the same instants.
    simulated = [r for r in recorder.records if r.scheduled or r.num_blocks_swapped_out]
    assert [record_key(r) for r in simulated] == [record_key(r) for r in ran]
    assert [r.time_s for r in simulated] == pytest.approx([r.time_s for r in ran], abs=1e-9)
    # Each token stamped at the next step's start: at most the host time after its step.
    for r in sim.requests:
        s = served[r.request_id]
        assert 0 <= r.first_token_time - s.first_token_time <= HOST_S
        assert 0 <= r.finished_time - s.finished_time <= HOST_S


def test_a_recorded_step_has_the_key_the_simulated_executor_costs_it_by():
    """``record_key`` reads a step record as ``SimulatedExecutor`` reads the scheduler's
    output (decode contexts including the new token, chunks, swapped blocks both ways)."""
    wl = synthetic_workload(60, request_rate=10.0, prompt_len="4:300", output_len="20:120",
                            seed=7)
    sched = SchedulerConfig(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256,
                            preemption_mode="swap")
    cache = CacheConfig(block_size=16, num_gpu_blocks=30, num_cpu_blocks=60)
    model = CostModel(get_model_spec("llama-3.1-8b"), get_hardware_spec("h100"))
    asked: list[tuple] = []

    class Asking:
        def step_time(self, num_decodes, decode_context, chunks=(), swap_blocks=0,
                      block_size=16):
            asked.append(batch_key(num_decodes, decode_context, chunks, swap_blocks))
            return model.step_time(num_decodes, decode_context, chunks, swap_blocks,
                                   block_size=block_size)

    recorder = StepRecorder()
    simulate(wl, sched, cache, Asking(), recorder=recorder)
    assert any(r.num_blocks_swapped_in for r in recorder.records)
    assert [record_key(r) for r in recorder.records] == asked


def test_a_batch_the_run_never_ran_goes_to_the_fallback_or_raises():
    wl = synthetic_workload(10, request_rate=5.0, prompt_len="8:40", output_len="2:8", seed=2)
    sched = SchedulerConfig(max_model_len=128)
    cache = CacheConfig(block_size=16, num_gpu_blocks=100)
    records, idle_after = _serve(wl, sched, cache, seed=3)
    fallback = CostModel(get_model_spec("llama-3.1-8b"), get_hardware_spec("h100"))
    steps = MeasuredSteps(records, idle_after=idle_after, fallback=fallback)
    assert steps.step_time(3, 12345) == fallback.step_time(3, 12345)
    assert steps.misses == 1 and steps.hits == 0
    with pytest.raises(KeyError, match="no recorded step"):
        MeasuredSteps(records).step_time(3, 12345)
    assert MeasuredSteps(records).step_time(0, 0) == 0.0  # nothing to do
