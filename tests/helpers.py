"""Shared test helpers: a fake executor and a checked scheduler loop."""

from __future__ import annotations

import random
import zlib

from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core import ModelRunnerOutput, Request, Scheduler, SchedulerOutput, StepRecorder
from kvloop.sampling_params import SamplingParams


class FakeClock:
    """A manual clock for deterministic timestamps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeExecutor:
    """Samples token 7 for every scheduled request (or ``eos`` for ids in ``stop_now``)."""

    def __init__(self, step_time: float = 0.01) -> None:
        self.step_time = step_time
        self.stop_now: set[str] = set()
        self.eos = 2

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput(
            sampled_token_ids={
                rid: [self.eos if rid in self.stop_now else 7] for rid in out.num_scheduled_tokens
            },
            step_time_s=self.step_time,
        )


def make_scheduler(
    *,
    num_gpu_blocks: int = 64,
    num_cpu_blocks: int = 0,
    block_size: int = 4,
    enable_prefix_caching: bool = True,
    record: bool = True,
    clock: FakeClock | None = None,
    **sched: object,
) -> Scheduler:
    sched.setdefault("max_model_len", 1024)
    return Scheduler(
        SchedulerConfig(**sched),  # type: ignore[arg-type]
        CacheConfig(
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            enable_prefix_caching=enable_prefix_caching,
        ),
        clock=clock or FakeClock(),
        recorder=StepRecorder() if record else None,
    )


def req(
    rid: str,
    prompt_len: int,
    max_tokens: int,
    *,
    priority: int = 0,
    arrival: float = 0.0,
    prompt: list[int] | None = None,
    salt: str | None = None,
    tenant: str = "",
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
) -> Request:
    if prompt is None:
        # Seeded from the id by a stable hash, so prompts (and prefix hits) are the same in
        # every process, whatever PYTHONHASHSEED is.
        rng = random.Random(zlib.crc32(rid.encode()))
        prompt = [rng.randrange(10_000, 50_000) for _ in range(prompt_len)]
    return Request(
        rid,
        prompt,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        arrival_time=arrival,
        priority=priority,
        cache_salt=salt,
        tenant=tenant,
        slo_ttft=slo_ttft,
        slo_tpot=slo_tpot,
    )


def step(s: Scheduler, ex: FakeExecutor | None = None, clock: FakeClock | None = None):
    """One checked step: schedule, execute, update; limits and invariants asserted."""
    ex = ex or FakeExecutor()
    out = s.schedule()
    assert out.total_num_scheduled_tokens <= s.config.max_num_batched_tokens
    assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
    assert len(s.running) <= s.config.max_num_seqs
    assert not (out.blocks_to_swap_in and out.blocks_to_swap_out)
    result = ex.execute(out)
    if clock is not None:
        clock.now += result.step_time_s
    s.update_from_output(out, result)
    s.check_invariants()
    return out


def run_all(s: Scheduler, ex: FakeExecutor | None = None, max_steps: int = 10_000) -> int:
    """Step until nothing is left; returns the number of steps."""
    n = 0
    while s.has_unfinished_requests():
        step(s, ex)
        n += 1
        assert n < max_steps, "scheduler did not drain"
    assert s.kv.num_used_blocks == 0, "blocks leaked"
    assert not s.kv.swapped_blocks and len(s.kv.cpu_free) == s.kv.num_cpu_blocks
    return n
