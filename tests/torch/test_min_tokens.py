"""``min_tokens``: EOS and stop token ids cannot end a request before it."""

from __future__ import annotations

import pytest

from conftest import TinyModel, make_runner
from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core import Scheduler
from kvloop.engine.llm_engine import LLMEngine
from kvloop.errors import InvalidRequestError
from kvloop.sampling_params import SamplingParams


def _engine(model: TinyModel) -> LLMEngine:
    runner = make_runner(model)
    sched = Scheduler(SchedulerConfig(max_model_len=256, max_num_batched_tokens=64),
                      CacheConfig(block_size=4, num_gpu_blocks=runner.num_gpu_blocks))
    return LLMEngine(sched, runner, vocab_size=model.vocab_size)


def _generate(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    engine.add_request("r", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out.token_ids
    raise AssertionError("no output")


def test_stop_token_ids_are_masked_until_min_tokens(llama_model: TinyModel) -> None:
    prompt = [5, 17, 99, 3, 42]
    free = llama_model.greedy(prompt, 8)
    stop = free[1]  # greedy decoding would stop at its second token
    stopped = _generate(_engine(llama_model), prompt,
                        SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop]))
    assert stopped == free[:2]
    held = _generate(_engine(llama_model), prompt,
                     SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop],
                                    min_tokens=5))
    assert len(held) >= 5 and stop not in held[:5] and held[0] == free[0]


@pytest.mark.parametrize("bad", [-1, 9, 2.5, True])
def test_min_tokens_is_validated(bad) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(max_tokens=8, min_tokens=bad)
    assert err.value.field == "min_tokens"
