"""Mixture-of-experts models in the simulator: configs in every spelling, the weights each
rank holds, and what a step's experts cost (tensor and expert parallelism)."""

from __future__ import annotations

import math

import pytest

from kvloop.executor.simulated import CostModel, ModelSpec, engine_overhead, get_hardware_spec
from kvloop.executor.simulated.specs import MoESpec

MIXTRAL = {  # mistralai/Mixtral-8x7B-v0.1 config.json
    "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "vocab_size": 32000, "torch_dtype": "bfloat16",
}
QWEN3_MOE = {  # Qwen/Qwen3-30B-A3B config.json (the fields read)
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8,
    "vocab_size": 151936, "mlp_only_layers": [], "torch_dtype": "bfloat16",
}
QWEN2_MOE = {  # Qwen/Qwen1.5-MoE-A2.7B config.json
    "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "num_attention_heads": 16,
    "num_key_value_heads": 16, "num_hidden_layers": 24, "num_experts": 60,
    "num_experts_per_tok": 4, "vocab_size": 151936, "torch_dtype": "bfloat16",
}
DEEPSEEK_MOE = {  # deepseek-ai/deepseek-moe-16b-base config.json (dense attention)
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 28,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
    "first_k_dense_replace": 1, "vocab_size": 102400, "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(("cfg", "params"), [
    (MIXTRAL, 46.70e9), (QWEN3_MOE, 30.53e9), (QWEN2_MOE, 14.32e9), (DEEPSEEK_MOE, 16.38e9)])
def test_moe_configs_give_the_published_parameter_counts(cfg: dict, params: float) -> None:
    spec = ModelSpec.from_hf_config(cfg, "m")
    assert spec.moe is not None
    assert spec.num_params == pytest.approx(params, rel=0.01)


def test_config_spellings() -> None:
    assert ModelSpec.from_hf_config(MIXTRAL, "m").moe == MoESpec(8, 2, 14336)
    assert ModelSpec.from_hf_config(QWEN2_MOE, "m").moe == MoESpec(60, 4, 1408, 5632)
    assert ModelSpec.from_hf_config(DEEPSEEK_MOE, "m").moe == MoESpec(64, 6, 1408, 2816, 1)
    dense = {k: v for k, v in MIXTRAL.items() if k != "num_local_experts"}
    assert ModelSpec.from_hf_config(dense, "m").moe is None
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelSpec.from_hf_config({**MIXTRAL, "num_experts_per_tok": None}, "m")
    with pytest.raises(ValueError, match="experts_per_token"):
        MoESpec(4, 5, 10)


def test_experts_touched_is_the_expected_number_of_distinct_experts() -> None:
    moe = MoESpec(8, 2, 100)
    assert moe.experts_touched(0) == 0
    assert moe.experts_touched(1) == pytest.approx(2.0)  # one token: exactly its k experts
    assert moe.experts_touched(1000) == pytest.approx(8.0)
    # by simulation: 8 experts, 2 each, 3 tokens
    expected = 8 * (1 - (6 / 8) ** 3)
    assert moe.experts_touched(3) == pytest.approx(expected)
    assert expected == pytest.approx(4.625)


def test_expert_parallel_ranks_hold_whole_experts() -> None:
    spec = ModelSpec.from_hf_config(MIXTRAL, "m")
    expert = 3 * 4096 * 14336
    tp2 = spec.linear_params(2)
    ep2 = spec.linear_params(2, ep=2)
    assert tp2 == ep2  # 8 experts halved either way
    ep8 = spec.linear_params(1, ep=8)
    assert ep8 - (spec.linear_params(1) - 32 * 8 * expert) == 32 * 1 * expert
    assert spec.weight_bytes(1, ep=8) < spec.weight_bytes(2)


def test_a_decode_step_reads_the_experts_its_tokens_touch() -> None:
    """Mixtral on H100 at TP 2: one token reads 2 of 8 experts per layer, 32 tokens nearly
    all 8; per rank the experts' weights are 44 GB, so a batch of 32 takes ~14-17 ms at the
    GPU's bandwidth."""
    spec, hw = ModelSpec.from_hf_config(MIXTRAL, "m"), get_hardware_spec("h100")
    cost = CostModel(spec, hw, tp=2, overhead=engine_overhead("none"))
    one, batch = cost.breakdown(1, 800)["experts"], cost.breakdown(32, 32 * 800)["experts"]
    rank_bytes = 32 * 8 * 3 * 4096 * 14336 * 2 / 2
    assert rank_bytes / hw.mem_bandwidth < batch < 1.3 * rank_bytes / hw.mem_bandwidth
    touched = 8 * (1 - (6 / 8) ** 32)
    assert one == pytest.approx(batch * 2 / touched, rel=0.15)
    with pytest.raises(ValueError, match="no experts"):
        CostModel(dense_mixtral(), hw, expert_parallel=True)


def dense_mixtral() -> ModelSpec:
    return ModelSpec.from_hf_config({k: v for k, v in MIXTRAL.items()
                                     if k != "num_local_experts"}, "dense")


def test_data_parallel_experts_serve_every_rank_and_pay_all_to_all() -> None:
    """With DP attention (dp > 1) and expert parallelism, a rank computes its experts' share
    of every rank's tokens and adds a dispatch and a combine per MoE layer; at dp = 1 the
    layer keeps tensor parallelism's all-reduce and no all-to-all."""
    spec, hw = ModelSpec.from_hf_config(QWEN3_MOE, "m"), get_hardware_spec("h100")
    none = engine_overhead("none")
    ep4 = CostModel(spec, hw, tp=4, overhead=none, expert_parallel=True)
    dp4 = CostModel(spec, hw, tp=1, dp=4, overhead=none, expert_parallel=True)
    assert ep4._alltoall is None and dp4._alltoall is not None
    a, b = ep4.breakdown(64, 64 * 1000), dp4.breakdown(64, 64 * 1000)
    assert b["allreduce"] == 0 and a["allreduce"] > 0
    # dp4 serves 4x the rows per expert: more expert work, plus the all-to-alls
    assert b["experts"] > a["experts"]
    comm = 2 * 48 * dp4._alltoall.time(64 * 8 * 2048 * 2 / 2)
    assert comm > 0 and math.isfinite(b["total"])
