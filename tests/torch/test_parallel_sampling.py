"""``n > 1`` on a real model: siblings forked from the prompt's KV (shared blocks, the
partial one copied on write) sample exactly what solo runs sample."""

from __future__ import annotations

import pytest

from conftest import TinyModel, make_runner, prompts_of
from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core import Scheduler
from kvloop.engine.llm_engine import LLMEngine
from kvloop.sampling_params import SamplingParams


def _engine(model: TinyModel, num_gpu_blocks: int = 64, mode: str = "recompute") -> LLMEngine:
    runner = make_runner(model, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=64)
    sched = Scheduler(
        SchedulerConfig(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8,
                        preemption_mode=mode),
        CacheConfig(block_size=runner.block_size, num_gpu_blocks=runner.num_gpu_blocks,
                    num_cpu_blocks=runner.num_cpu_blocks),
    )
    return LLMEngine(sched, runner, vocab_size=model.vocab_size)


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
    done: dict = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[(out.request_id, out.index)] = out
        engine.scheduler.check_invariants()
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv.num_used_blocks == 0
    return done


@pytest.mark.parametrize(("blocks", "mode"), [(64, "recompute"), (14, "recompute"),
                                              (14, "swap")])
def test_greedy_siblings_match_the_solo_greedy_run(llama_model: TinyModel, blocks: int,
                                                   mode: str) -> None:
    engine = _engine(llama_model, blocks, mode)
    prompts = prompts_of([10, 7, 9], llama_model.vocab_size, seed=21)  # 10, 7: partial blocks
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=2)
    done = _run(engine, prompts, params)
    assert len(done) == 6
    for i, p in enumerate(prompts):
        expected = llama_model.greedy(p, 12)
        assert done[(f"p{i}", 0)].token_ids == expected
        assert done[(f"p{i}", 1)].token_ids == expected
    if blocks == 14:
        assert engine.scheduler.stats.num_preemptions > 0


def test_seeded_groups_are_reproducible_and_siblings_differ(llama_model: TinyModel) -> None:
    prompts = prompts_of([9], llama_model.vocab_size, seed=22)
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, n=3, seed=5)
    first = _run(_engine(llama_model), prompts, params)
    again = _run(_engine(llama_model), prompts, params)
    outs = [first[("p0", i)].token_ids for i in range(3)]
    assert outs == [again[("p0", i)].token_ids for i in range(3)]
    assert len({tuple(o) for o in outs}) > 1


def test_the_offline_api_returns_every_sequence(llama_model: TinyModel) -> None:
    from kvloop.engine.llm import LLM

    llm = LLM(str(llama_model.path), skip_tokenizer_init=True, dtype="float32", device="cpu",
              block_size=4, num_gpu_blocks=64, swap_space=0.0, max_model_len=256)
    prompt = prompts_of([7], llama_model.vocab_size, seed=23)[0]
    (out,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5, n=2,
                                                 ignore_eos=True), use_tqdm=False)
    assert out.outputs is not None and [o.index for o in out.outputs] == [0, 1]
    expected = llama_model.greedy(prompt, 5)
    assert out.token_ids == expected and all(o.token_ids == expected for o in out.outputs)
