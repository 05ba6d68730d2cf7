"""The default token budget: CUDA's fixed one, a CPU one from the model's measured cost."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conftest import TinyModel
from kvloop.engine.args import EngineArgs
from kvloop.engine.llm_engine import LLMEngine
from kvloop.executor.torch import budget

ARGS = {"dtype": "float32", "device": "cpu", "block_size": 4, "num_gpu_blocks": 64,
        "swap_space": 0.0, "max_model_len": 256, "skip_tokenizer_init": True}


@pytest.mark.parametrize(("per_token", "expected"), [(0.1, 64), (1e-3, 448), (1e-6, 2048)])
def test_the_cpu_budget_follows_the_cost_per_token(monkeypatch, per_token, expected):
    monkeypatch.setattr(budget, "prefill_time", lambda runner, t: per_token * t)
    cpu = SimpleNamespace(device=SimpleNamespace(type="cpu"))
    chosen, why = budget.default_token_budget(cpu)
    assert chosen == expected and "ms per prompt token" in why
    cuda = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    assert budget.default_token_budget(cuda) == (2048, "the CUDA default")


@pytest.mark.parametrize("per_token_ms", [
    [36.0, 20.0, 1.4, 1.5, 1.5],  # cold first step, warm from the third
    [36.0, 63.6, 40.0, 10.2, 4.0, 1.4, 1.5, 1.4],  # slow for five probes after an install
])
def test_a_cold_start_does_not_set_the_budget(monkeypatch, per_token_ms):
    """The first prefills of a process, or of a machine just busy installing, are slow; the
    first is run untimed and the rest until the fastest stops improving, so a cold start
    picks what a warm one does."""
    calls: list[int] = []
    times = iter([ms / 1000 * 64 for ms in per_token_ms])

    def fake(runner, tokens):
        calls.append(tokens)
        return next(times)

    monkeypatch.setattr(budget, "prefill_time", fake)
    cpu = SimpleNamespace(device=SimpleNamespace(type="cpu"))
    chosen, why = budget.default_token_budget(cpu)
    assert len(set(calls)) == 1  # the warm-up has the probes' size
    assert len(calls) == len(per_token_ms)  # stopped two probes after the fastest
    assert chosen == int(0.5 / 0.0014) // 64 * 64 == 320
    assert "1.4 ms per prompt token" in why


def test_the_engine_measures_and_says_what_it_chose(llama_model: TinyModel):
    auto = LLMEngine.from_args(EngineArgs(model=str(llama_model.path), **ARGS))
    chosen = auto.scheduler.config.max_num_batched_tokens
    assert 64 <= chosen <= 2048 and chosen % 64 == 0
    assert auto.token_budget_note.startswith(f"{chosen} tokens per step (for ~0.5 s steps")
    assert not auto.executor.requests  # the probe left nothing behind
    given = LLMEngine.from_args(EngineArgs(model=str(llama_model.path),
                                           max_num_batched_tokens=96, **ARGS))
    assert given.scheduler.config.max_num_batched_tokens == 96
    assert given.token_budget_note == "96 tokens per step (as given)"
