"""A model step that fails at any point never yields a wrong answer.

A fault is injected once, at one point of a step that moves KV (before or after its swap-out
or swap-in copies, after the forward pass wrote KV, in sampling), under both preemption
modes, on a pool small enough that requests are preempted all the time. Every request must
then either fail with an error or finish with exactly the tokens a solo greedy run gives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from conftest import TinyModel, make_runner, prompts_of
from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core import Scheduler, SchedulerOutput
from kvloop.engine.llm_engine import LLMEngine
from kvloop.sampling_params import SamplingParams


class InjectedFault(RuntimeError):
    """The fault the test raises inside the runner."""


class FaultyRunner:
    """The real runner, failing once at ``point`` in the first step ``when`` selects.

    Points: ``before_``/``after_`` the runner's ``swap_out``, ``swap_in``, ``forward`` and
    ``sample``; ``scheduler_before_output`` (``schedule()`` dies after its passes decided a
    swap-out, before returning) and ``update_before_commit_one_token`` (applying the step's
    results dies half-way, after tokens were appended)."""

    def __init__(self, runner: Any, point: str, when: Callable[[SchedulerOutput], bool]):
        self.runner, self.point, self.when = runner, point, when
        self.fired = False
        self.armed = point.startswith("scheduler_")
        cache, model, sampler = runner.kv_cache, runner.model, runner.sampler
        self._wrap(cache, "swap_out")
        self._wrap(cache, "swap_in")
        self._wrap(model, "forward")
        self._wrap(sampler, "sample")

    def attach(self, scheduler: Scheduler) -> None:
        self._wrap(scheduler.kv, "commit_one_token", "update_")
        build = scheduler._build_output

        def build_output(b: Any) -> SchedulerOutput:
            if b.swap_out:
                self._maybe_fail("scheduler_before_output")
            return build(b)

        scheduler._build_output = build_output  # type: ignore[method-assign]

    def _wrap(self, obj: Any, name: str, prefix: str = "") -> None:
        original = getattr(obj, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self._maybe_fail(f"{prefix}before_{name}")
            result = original(*args, **kwargs)
            self._maybe_fail(f"{prefix}after_{name}")
            return result

        setattr(obj, name, wrapped)

    def _maybe_fail(self, where: str) -> None:
        if self.armed and where == self.point:
            self.armed, self.fired = False, True
            raise InjectedFault(where)

    def execute(self, out: SchedulerOutput) -> Any:
        if not self.point.startswith("scheduler_"):
            self.armed = not self.fired and self.when(out)
        return self.runner.execute(out)


def _swaps_out(out: SchedulerOutput) -> bool:
    return bool(out.blocks_to_swap_out)


def _swaps_in(out: SchedulerOutput) -> bool:
    return bool(out.blocks_to_swap_in)


def _preempts(out: SchedulerOutput) -> bool:
    return bool(out.preempted_request_ids)


CASES = [
    # (preemption mode, point, the step it fails in)
    ("swap", "before_swap_out", _swaps_out),
    ("swap", "after_swap_out", _swaps_out),
    ("swap", "after_forward", _swaps_out),
    ("swap", "before_sample", _swaps_out),
    ("swap", "before_swap_in", _swaps_in),
    ("swap", "after_swap_in", _swaps_in),
    ("swap", "after_forward", _swaps_in),
    ("recompute", "before_forward", _preempts),
    ("recompute", "after_forward", _preempts),
    ("recompute", "before_sample", _preempts),
    ("swap", "scheduler_before_output", _swaps_out),
    ("swap", "update_before_commit_one_token", _swaps_out),
    ("recompute", "update_before_commit_one_token", _preempts),
]


@pytest.mark.parametrize(("mode", "point", "when"), CASES,
                         ids=[f"{m}-{p}-{w.__name__.strip('_')}" for m, p, w in CASES])
def test_a_failed_step_never_yields_a_wrong_answer(
    llama_model: TinyModel, mode: str, point: str, when: Callable[[SchedulerOutput], bool]
) -> None:
    max_tokens = 16
    runner = make_runner(llama_model, num_gpu_blocks=14, num_cpu_blocks=40)
    faulty = FaultyRunner(runner, point, when)
    sched = Scheduler(
        SchedulerConfig(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8,
                        preemption_mode=mode, cost_aware_preemption=False),
        CacheConfig(block_size=runner.block_size, num_gpu_blocks=runner.num_gpu_blocks,
                    num_cpu_blocks=runner.num_cpu_blocks),
    )
    faulty.attach(sched)
    engine = LLMEngine(sched, faulty, vocab_size=llama_model.vocab_size)
    prompts = prompts_of([10, 7, 12, 9, 11, 8], llama_model.vocab_size, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        try:
            outputs = engine.step()
        except InjectedFault:  # a scheduler error propagates, its decisions undone
            assert point.startswith("scheduler_")
            outputs = [engine.abort_request(rid) for rid in list(engine._tracked)
                       if sched.requests.get(rid) is None]
        for out in outputs:
            if out is not None and out.finished:
                done[out.request_id] = out
        sched.check_invariants()
    assert faulty.fired, f"the workload never reached {point}"
    assert not engine.has_unfinished_requests()
    assert sched.kv.num_used_blocks == 0 and sched.kv.num_free_cpu_blocks == sched.kv.num_cpu_blocks
    failed = [rid for rid, o in done.items() if o.error is not None]
    assert failed, "the fault failed no request"
    for i, p in enumerate(prompts):
        out = done[f"r{i}"]
        if out.error is None:
            assert out.token_ids == llama_model.greedy(p, max_tokens), f"r{i} is wrong"
        else:
            assert out.finish_reason == "error" and "InjectedFault" in out.error


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_nan_row_fails_its_request_alone(llama_model: TinyModel, temperature: float) -> None:
    """Logits that are not numbers for one request (a broken model, an overflow) fail that
    request with an error saying so, at the step they appear; the requests beside it in the
    same steps still give a solo run's tokens, and every block returns to the pool."""
    runner = make_runner(llama_model, num_gpu_blocks=40)
    sample = runner.sampler.sample

    def poisoned(logits: Any, states: list[Any]) -> Any:
        for row, st in enumerate(states):  # NOTE: the victim is the one asking 9 tokens
            if st.params.max_tokens == 9 and len(st.output_token_ids) >= 2:
                logits[row, 5] = float("nan")
        return sample(logits, states)

    runner.sampler.sample = poisoned  # type: ignore[method-assign]
    sched = Scheduler(SchedulerConfig(max_model_len=256, max_num_batched_tokens=64),
                      CacheConfig(block_size=runner.block_size,
                                  num_gpu_blocks=runner.num_gpu_blocks))
    engine = LLMEngine(sched, runner, vocab_size=llama_model.vocab_size)
    prompts = prompts_of([9, 6, 11], llama_model.vocab_size, seed=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    victim = SamplingParams(temperature=temperature, max_tokens=9, ignore_eos=True, seed=1)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, victim if i == 1 else greedy)
    done = {}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        sched.check_invariants()
    assert not engine.has_unfinished_requests() and sched.kv.num_used_blocks == 0
    assert done["r1"].finish_reason == "error" and "NaN" in done["r1"].error
    assert len(done["r1"].token_ids) == 2
    for i in (0, 2):
        assert done[f"r{i}"].error is None
        assert done[f"r{i}"].token_ids == llama_model.greedy(prompts[i], 8)
