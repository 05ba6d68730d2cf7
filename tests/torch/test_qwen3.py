"""Qwen3 (per-head query and key RMSNorm before RoPE, head_dim apart from hidden / heads)
gives transformers' greedy tokens through kvloop's fused CPU ops and through plain torch,
and its norms survive the ready-to-run weights."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import assert_matches, drive, make_runner, prompts_of  # noqa: E402
from kvloop.executor.torch import ready_weights  # noqa: E402
from kvloop.executor.torch.models import ModelConfig  # noqa: E402


def test_the_config_names_qwen3_and_its_head_dim(qwen3_model) -> None:
    cfg = ModelConfig.from_pretrained(qwen3_model.path)
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.head_dim == 32
    assert cfg.head_dim != cfg.hidden_size // cfg.num_heads and not cfg.qkv_bias


def test_greedy_tokens_match_transformers(qwen3_model) -> None:
    """On the path this model loads with (``test_every_path`` runs every path)."""
    runner = make_runner(qwen3_model, max_num_batched_tokens=24)
    model = runner.model
    assert model.layers[0].q_norm is not None and model.layers[0].k_norm is not None
    assert model.decode_layers is None  # the one-call step has no query/key norms
    prompts = prompts_of([5, 30, 11, 3], qwen3_model.vocab_size, seed=4)
    reqs, _ = drive(runner, prompts, 10, arrive_at=[0, 0, 2, 5])  # chunks beside decodes
    assert_matches(qwen3_model, reqs, 10)


def test_the_norms_come_back_from_the_ready_weights(qwen3_model, monkeypatch,
                                                     tmp_path) -> None:
    import threading

    monkeypatch.setattr(ready_weights, "ready_dir", lambda: tmp_path)
    first = make_runner(qwen3_model, dtype="bfloat16").model
    if not ready_weights.cacheable(first):
        pytest.skip("bfloat16 matrices are oneDNN's here: no ready-to-run weights to read")
    for thread in threading.enumerate():
        if thread.name == "kvloop-save-ready-weights":
            thread.join(60)
    second = make_runner(qwen3_model, dtype="bfloat16").model
    assert second.loaded_ready and not first.loaded_ready
    for a, b in zip(first.layers, second.layers, strict=True):
        assert torch.equal(a.q_norm, b.q_norm) and torch.equal(a.k_norm, b.k_norm)
