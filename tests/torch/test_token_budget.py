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


def _cpu_runner(tmp_path) -> SimpleNamespace:
    """What ``default_token_budget`` reads of a CPU runner (its model folder: ``tmp_path``)."""
    (tmp_path / "config.json").write_text("{}")
    return SimpleNamespace(device=SimpleNamespace(type="cpu"), model_path=tmp_path,
                           dtype="float32", quantization=None)


@pytest.mark.parametrize(("per_token", "expected", "words"), [
    (0.1, 64, "the floor: ~0.5 s steps at ~100 ms per prompt token would allow 5"),
    (1e-3, 448, "for ~0.5 s steps at ~1 ms per prompt token"),
    (1e-6, 2048, "the ceiling: ~0.5 s steps at ~0.001 ms per prompt token would allow 499968"),
])
def test_the_cpu_budget_follows_the_cost_per_token(monkeypatch, tmp_path, per_token, expected,
                                                   words):
    monkeypatch.setattr(budget, "prefill_time", lambda runner, t: per_token * t)
    chosen, why = budget.default_token_budget(_cpu_runner(tmp_path))
    assert chosen == expected and why.startswith(f"{words}, measured now")
    cuda = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    assert budget.default_token_budget(cuda) == (2048, "the CUDA default")


def test_measured_once_then_read_whatever_the_load(monkeypatch, tmp_path):
    """A later start reads the recorded cost, however busy the machine is meanwhile; a
    profile run measures again; a damaged record is measured again."""
    runner = _cpu_runner(tmp_path)
    per_token = [1e-3]
    monkeypatch.setattr(budget, "prefill_time", lambda runner, t: per_token[0] * t)
    assert budget.default_token_budget(runner)[0] == 448
    per_token[0] = 50e-3  # a neighbour now takes the CPU
    chosen, why = budget.default_token_budget(runner)
    assert chosen == 448 and "on this machine" in why  # (and "while it was busy" if so)
    assert why.endswith("; kvloop profile --token-budget measures again")
    assert budget.default_token_budget(runner, measure=True)[0] == 64
    assert budget.default_token_budget(runner)[0] == 64  # the new measurement is kept
    budget.record_path(runner).write_text("{not json")
    per_token[0] = 1e-3
    assert budget.default_token_budget(runner)[0] == 448
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')  # another model
    per_token[0] = 2e-3
    assert budget.default_token_budget(runner)[0] == 192


def test_a_busy_measurement_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(budget, "prefill_time", lambda runner, t: 1e-3 * t)
    monkeypatch.setattr(budget, "_load_per_cpu", lambda: 1.5)
    why = budget.default_token_budget(_cpu_runner(tmp_path))[1]
    assert why.endswith("the machine was busy (1.5 runnable per CPU): kvloop profile "
                        "--token-budget on an idle one measures again")


@pytest.mark.parametrize("per_token_ms", [
    [36.0, 20.0, 1.4, 1.5, 1.5],  # cold first step, warm from the third
    [36.0, 63.6, 40.0, 10.2, 4.0, 1.4, 1.5, 1.4],  # slow for five probes after an install
])
def test_a_cold_start_does_not_set_the_budget(monkeypatch, tmp_path, per_token_ms):
    """The first prefills of a process, or of a machine just busy installing, are slow; the
    first is run untimed and the rest until the fastest stops improving, so a cold start
    picks what a warm one does."""
    calls: list[int] = []
    times = iter([ms / 1000 * 64 for ms in per_token_ms])

    def fake(runner, tokens):
        calls.append(tokens)
        return next(times)

    monkeypatch.setattr(budget, "prefill_time", fake)
    chosen, why = budget.default_token_budget(_cpu_runner(tmp_path))
    assert len(set(calls)) == 1  # the warm-up has the probes' size
    assert len(calls) == len(per_token_ms)  # stopped two probes after the fastest
    assert chosen == int(0.5 / 0.0014) // 64 * 64 == 320
    assert "1.4 ms per prompt token" in why


def test_the_engine_measures_and_says_what_it_chose(llama_model: TinyModel):
    auto = LLMEngine.from_args(EngineArgs(model=str(llama_model.path), **ARGS))
    chosen = auto.scheduler.config.max_num_batched_tokens
    assert 64 <= chosen <= 2048 and chosen % 64 == 0
    assert auto.token_budget_note.startswith(f"{chosen} tokens per step (")
    # NOTE: a busy machine (as CI can be) adds a hint after these words.
    assert "measured now and kept for later starts" in auto.token_budget_note
    again = LLMEngine.from_args(EngineArgs(model=str(llama_model.path), **ARGS))
    assert again.scheduler.config.max_num_batched_tokens == chosen  # read, not re-timed
    assert "on this machine" in again.token_budget_note  # NOTE: CI may be busy: then says so
    assert again.token_budget_note.endswith("; kvloop profile --token-budget measures again)")
    assert not auto.executor.requests  # the probe left nothing behind
    given = LLMEngine.from_args(EngineArgs(model=str(llama_model.path),
                                           max_num_batched_tokens=96, **ARGS))
    assert given.scheduler.config.max_num_batched_tokens == 96
    assert given.token_budget_note == "96 tokens per step (as given)"


def test_a_busy_measurement_says_so_at_later_starts(monkeypatch, tmp_path) -> None:
    runner = _cpu_runner(tmp_path)
    monkeypatch.setattr(budget, "_load_per_cpu", lambda: 1.8)
    monkeypatch.setattr(budget, "measure_per_token", lambda runner: 1e-3)
    _, first = budget.default_token_budget(runner)
    assert "the machine was busy (1.8 runnable per CPU)" in first
    _, later = budget.default_token_budget(runner)
    assert "on this machine while it was busy; kvloop profile --token-budget" in later
