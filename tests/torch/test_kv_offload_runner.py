"""The prefix cache's host tier on the real runner: loaded KV gives the same greedy tokens.

Conversations resend their earlier turns; fillers between the turns push those prefixes off
a small device pool, so the later turns hit the host tier and load its blocks instead of
recomputing them. Outputs must equal transformers' greedy continuations, with and without
faults injected while a step stores or loads, and every block must come back.
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

MAX_TOKENS = 6


class Fault(RuntimeError):
    """Injected."""


def _workload(vocab: int) -> list[tuple[int, list[int]]]:
    """(arrival step, prompt): two conversations of three turns, fillers between turns."""
    base = prompts_of([14, 11], vocab, seed=5)
    extra = prompts_of([5, 6, 4, 7], vocab, seed=6)
    fill = prompts_of([30, 29, 31, 28], vocab, seed=7)
    out = [(0, base[0]), (0, base[1]), (6, fill[0]), (6, fill[1]),
           (14, base[0] + extra[0]), (14, base[1] + extra[1]), (20, fill[2]), (20, fill[3]),
           (28, base[0] + extra[0] + extra[2]), (28, base[1] + extra[1] + extra[3])]
    return out


def _run(model: TinyModel, offload_bytes: int, fault: Callable[[SchedulerOutput], str] | None
         = None) -> tuple[dict[str, Any], Scheduler]:
    runner = make_runner(model, num_gpu_blocks=16, num_cpu_blocks=8,
                         kv_offload_bytes=offload_bytes)
    sched = Scheduler(
        SchedulerConfig(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4),
        CacheConfig(block_size=runner.block_size, num_gpu_blocks=runner.num_gpu_blocks,
                    num_cpu_blocks=runner.num_cpu_blocks,
                    kv_offload_blocks=runner.num_offload_blocks))
    armed: dict[str, str] = {}
    cache = runner.kv_cache
    for name in ("swap_out", "swap_in"):
        original = getattr(cache, name)

        def wrapped(pairs: Any, _orig: Any = original, _name: str = name) -> Any:
            if pairs and armed.pop(_name, None):
                _orig(pairs[: len(pairs) // 2])  # half of the copies ran
                raise Fault(_name)
            return _orig(pairs)

        setattr(cache, name, wrapped)
    execute = runner.execute

    def execute_with_faults(out: SchedulerOutput) -> Any:
        if fault is not None:
            where = fault(out)
            if where:
                armed[where] = where
        return execute(out)

    runner.execute = execute_with_faults  # type: ignore[method-assign]
    engine = LLMEngine(sched, runner, vocab_size=model.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    work = _workload(model.vocab_size)
    done: dict[str, Any] = {}
    for step in range(400):
        for i, (at, prompt) in enumerate(work):
            if at == step:
                engine.add_request(f"q{i}", prompt, params)
        if step > work[-1][0] and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        sched.check_invariants()
    assert not engine.has_unfinished_requests()
    kv = sched.kv
    assert kv.num_used_blocks == 0 and not kv.swapped_blocks, "blocks leaked"
    host = kv.host
    assert len(host.free) + len(host.releasing) + len(host.cached) == kv.num_cpu_blocks
    for i, (_, prompt) in enumerate(work):
        out = done[f"q{i}"]
        if out.error is None:
            assert out.token_ids == model.greedy(prompt, MAX_TOKENS), f"q{i} is wrong"
        else:
            assert "Fault" in out.error
    return done, sched


def test_host_tier_loads_and_matches_greedy(llama_model: TinyModel) -> None:
    _, plain = _run(llama_model, 0)
    _, tiered = _run(llama_model, 1 << 20)
    st = tiered.kv.host.stats
    assert st.blocks_loaded > 0 and st.blocks_stored > 0
    assert tiered.stats.prefix_cache_hits > plain.stats.prefix_cache_hits


@pytest.mark.parametrize("where", ["swap_out", "swap_in"])
def test_a_fault_while_storing_or_loading_loses_nothing(llama_model: TinyModel,
                                                        where: str) -> None:
    fired = []

    def fault(out: SchedulerOutput) -> str:
        moves = out.blocks_to_offload if where == "swap_out" else out.blocks_to_load
        if moves and len(fired) < 2:
            fired.append(out.step)
            return where
        return ""

    done, _ = _run(llama_model, 1 << 20, fault)
    assert fired, "no step stored or loaded"
    assert any(o.error is not None for o in done.values())
