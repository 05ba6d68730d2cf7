"""Mixture-of-experts models in the real engine (Mixtral; Qwen3-MoE with a dense layer, its
own expert width and unnormalised top-k weights): transformers' greedy tokens through the
fused CPU ops and through plain torch, with chunked prefill beside decodes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import (  # noqa: E402
    assert_matches,
    build_tiny,
    drive,
    make_runner,
    mixtral_config,
    prompts_of,
    qwen3_moe_config,
)
from kvloop.executor.torch.models import ModelConfig  # noqa: E402

CONFIGS = {"mixtral": mixtral_config, "qwen3_moe": qwen3_moe_config}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def moe_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    return build_tiny(tmp_path_factory.mktemp(request.param), CONFIGS[request.param](), seed=3)


def test_the_config_names_the_experts(moe_model) -> None:
    cfg = ModelConfig.from_pretrained(moe_model.path)
    assert cfg.moe is not None and cfg.moe.num_experts == 4 and cfg.moe.top_k == 2
    if cfg.architecture == "Qwen3MoeForCausalLM":
        assert cfg.moe.layers == {0, 2} and not cfg.moe.normalize
    else:
        assert cfg.moe.layers == {0, 1, 2} and cfg.moe.normalize


def test_greedy_tokens_match_transformers(moe_model) -> None:
    """On the path this model loads with (``test_every_path`` runs every path)."""
    runner = make_runner(moe_model, max_num_batched_tokens=24)
    model = runner.model
    assert any(layer.moe is not None for layer in model.layers)
    assert model.decode_layers is None  # the one-call step has no experts
    prompts = prompts_of([5, 30, 11, 3], moe_model.vocab_size, seed=4)
    reqs, _ = drive(runner, prompts, 10, arrive_at=[0, 0, 2, 5])
    assert_matches(moe_model, reqs, 10)
