"""Roofline cost model and model/hardware specs: formulas, presets, sizing, ballparks."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvloop.executor.simulated.cost_model import CostModel, Efficiency
from kvloop.executor.simulated.specs import (
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    GiB,
    HardwareSpec,
    ModelSpec,
    get_hardware_spec,
    get_model_spec,
    num_cpu_blocks,
    num_gpu_blocks,
)

TINY = ModelSpec(
    "tiny",
    num_layers=2,
    hidden_size=8,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    intermediate_size=16,
    vocab_size=10,
)
TOY_HW = HardwareSpec(
    "toy",
    peak_flops=1e6,
    mem_bandwidth=1e4,
    mem_bytes=10**6,
    host_link_bandwidth=1e3,
    allreduce_bandwidth=1e3,
    allreduce_latency_s=1e-3,
)
IDEAL = Efficiency(
    mfu=1.0,
    mbu=1.0,
    attn_mfu=1.0,
    attn_mbu=1.0,
    step_overhead_s=0.0,
    seq_overhead_s=0.0,
    host_link_fraction=1.0,
)
SMOLLM2_CONFIG = {  # HuggingFaceTB/SmolLM2-135M config.json (the keys the spec reads)
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
}


def llama8b_h100() -> CostModel:
    return CostModel(get_model_spec("llama-3.1-8b"), get_hardware_spec("h100"))


# --- specs -----------------------------------------------------------------------------


def test_tiny_spec_counts_by_hand() -> None:
    # per layer: q,o 2*8*(2*4)=128; k,v 2*8*(1*4)=64; mlp 3*8*16=384 -> 576; two layers 1152
    assert TINY.linear_params() == 1152
    # + embedding and lm_head 10*8 each + norms (2*2+1)*8
    assert TINY.num_params == 1152 + 160 + 40
    assert TINY.weight_bytes() == 2 * 1352
    assert TINY.streamed_weight_bytes() == 2 * (1352 - 80)  # input embedding only gathered
    assert TINY.kv_bytes_per_token() == 2 * 2 * 1 * 4 * 2
    assert TINY.kv_block_bytes(16) == 16 * 32
    # tp=2: heads and MLP columns halve, the single KV head is replicated, vocab split
    assert TINY.kv_bytes_per_token(2) == TINY.kv_bytes_per_token(1)
    assert TINY.weight_bytes(2) == 2 * (2 * (64 + 64 + 192) + 2 * 5 * 8 + 40)


def test_presets_parse_with_known_parameter_counts() -> None:
    expected = {
        "llama-3.1-8b": 8.03e9,
        "llama-3.1-70b": 70.55e9,
        "qwen2.5-7b": 7.62e9,
        "smollm2-135m": 134.5e6,
    }
    for name, params in expected.items():
        spec = get_model_spec(name)
        assert spec is MODEL_PRESETS[name]
        assert spec.num_params == pytest.approx(params, rel=0.005)
    assert get_model_spec("llama-3.1-8b").kv_bytes_per_token() == 128 * 1024
    for name in ("a100-80gb", "h100", "h200", "l4", "rtx-4090"):
        assert get_hardware_spec(name) is HARDWARE_PRESETS[name]


def test_kv_heads_replicate_beyond_their_count() -> None:
    m = get_model_spec("llama-3.1-70b")  # 8 KV heads
    assert m.kv_heads_per_rank(16) == 1
    assert m.kv_bytes_per_token(16) == m.kv_bytes_per_token(8) == 2 * 80 * 128 * 2


@pytest.mark.parametrize("tp", [0, -2, 3, 1.0, True])
def test_bad_tensor_parallel_size(tp: object) -> None:
    with pytest.raises(ValueError, match="tensor parallel size"):
        get_model_spec("llama-3.1-8b").check_tp(tp)  # type: ignore[arg-type]


def test_from_hf_config_file_and_folder(tmp_path) -> None:
    folder = tmp_path / "SmolLM2-135M"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    for arg in (str(folder), str(folder / "config.json")):
        spec = get_model_spec(arg)
        assert spec.name == "SmolLM2-135M"
        assert spec.num_params == MODEL_PRESETS["smollm2-135m"].num_params
        assert spec.head_dim == 64 and spec.tie_word_embeddings


def test_from_hf_config_defaults_and_dtype() -> None:
    cfg = {k: v for k, v in SMOLLM2_CONFIG.items() if k != "num_key_value_heads"}
    spec = ModelSpec.from_hf_config({**cfg, "torch_dtype": "float32"}, "m")
    assert spec.num_kv_heads == 9 and spec.head_dim == 576 // 9 and spec.dtype_bytes == 4
    assert ModelSpec.from_hf_config({**cfg, "torch_dtype": None}, "m").dtype_bytes == 2


def test_from_hf_config_errors_name_key_and_file(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in SMOLLM2_CONFIG.items() if k != "vocab_size"}))
    with pytest.raises(ValueError, match="vocab_size") as err:
        get_model_spec(str(path))
    assert str(path) in str(err.value)
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json"):
        get_model_spec(str(tmp_path))


def test_unknown_names_list_the_choices() -> None:
    with pytest.raises(ValueError) as err:
        get_model_spec("gpt-17")
    assert str(err.value) == (
        "unknown model 'gpt-17': choose a preset (llama-3.1-8b, llama-3.1-70b, qwen2.5-7b, "
        "smollm2-135m) or give a path to a Hugging Face config.json"
    )
    with pytest.raises(ValueError, match="a100-80gb, h100, h200, l4, rtx-4090"):
        get_hardware_spec("tpu-v9")


def test_num_gpu_blocks_llama8b_h100() -> None:
    m, hw = get_model_spec("llama-3.1-8b"), get_hardware_spec("h100")
    assert 15.5e9 < m.weight_bytes() < 16.5e9
    blocks = num_gpu_blocks(m, hw, block_size=16)
    # 0.9 * 79.6 GiB - 15 GiB weights - ~2 GiB reserve = ~54.6 GiB of 2 MiB blocks
    assert 25_000 < blocks < 30_000
    assert num_gpu_blocks(m, hw, block_size=16, activation_reserve_bytes=0) > blocks
    assert num_gpu_blocks(m, hw, block_size=16, tp=2) > 2 * blocks


def test_num_gpu_blocks_errors() -> None:
    m70, h100 = get_model_spec("llama-3.1-70b"), get_hardware_spec("h100")
    with pytest.raises(ValueError, match=r"141 GB per GPU at tp=1.*tensor-parallel-size"):
        num_gpu_blocks(m70, h100, block_size=16)
    with pytest.raises(ValueError, match="no room for a KV cache"):
        num_gpu_blocks(
            get_model_spec("llama-3.1-8b"),
            get_hardware_spec("l4"),
            block_size=16,
            gpu_memory_utilization=0.7,
        )
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        num_gpu_blocks(m70, h100, block_size=16, tp=8, gpu_memory_utilization=1.5)


def test_num_cpu_blocks() -> None:
    m = get_model_spec("llama-3.1-8b")  # 2 MiB per 16-token block
    assert num_cpu_blocks(m, block_size=16, swap_space_gib=4) == 4 * GiB // (2 << 20)
    assert num_cpu_blocks(m, block_size=16, swap_space_gib=0) == 0
    with pytest.raises(ValueError):
        num_cpu_blocks(m, block_size=16, swap_space_gib=-1)


# --- cost model formulas -----------------------------------------------------------------


def test_step_time_matches_hand_formula() -> None:
    cm = CostModel(TINY, TOY_HW, efficiency=IDEAL)
    tokens, seqs, pairs, reads = 5, 2, 12.0, 9
    flops = 2 * 1152 * tokens + 2 * 80 * seqs
    gemm = max(flops / 1e6, TINY.streamed_weight_bytes() / 1e4)
    attn = max(4 * 2 * 2 * 4 * pairs / 1e6, (reads + tokens) * 32 / 1e4)
    swap, copy = 3 * 16 * 32 / 1e3, 2 * 1 * 16 * 32 / 1e4
    got = cm.step_time(tokens, seqs, pairs, reads, swap_blocks=3, copy_blocks=1)
    assert got == pytest.approx(gemm + attn + swap + copy)
    parts = cm.breakdown(tokens, seqs, pairs, reads, swap_blocks=3, copy_blocks=1)
    assert parts["total"] == pytest.approx(got)
    assert parts["allreduce"] == 0.0


def test_allreduce_and_overheads() -> None:
    eff = Efficiency(
        mfu=1.0,
        mbu=1.0,
        attn_mfu=1.0,
        attn_mbu=1.0,
        step_overhead_s=0.01,
        seq_overhead_s=0.001,
        host_link_fraction=1.0,
    )
    parts = CostModel(TINY, TOY_HW, tp=2, efficiency=eff).breakdown(4, 3, 4.0, 4)
    ring = 2 * 2 * (2 * 1 / 2 * 4 * 8 * 2 / 1e3 + 1e-3)  # 2 per layer, 2 layers
    assert parts["allreduce"] == pytest.approx(ring)
    assert parts["overhead"] == pytest.approx(0.01 + 3 * 0.001)


def test_empty_step_costs_nothing_but_its_moves() -> None:
    cm = llama8b_h100()
    assert cm.step_time(0, 0, 0.0, 0) == 0.0
    assert cm.breakdown(0, 0, 0.0, 0)["total"] == 0.0
    swap_only = cm.step_time(0, 0, 0.0, 0, swap_blocks=10)
    assert swap_only > 0.0
    assert cm.breakdown(0, 0, 0.0, 0, swap_blocks=10)["total"] == pytest.approx(swap_only)


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.integers(1, 8192),
    seqs=st.integers(1, 256),
    pairs=st.floats(0, 1e8),
    reads=st.integers(0, 1_000_000),
    swaps=st.integers(0, 64),
    which=st.integers(0, 4),
    extra=st.integers(1, 4096),
)
def test_more_work_is_never_faster(tokens, seqs, pairs, reads, swaps, which, extra) -> None:
    cm = llama8b_h100()
    args = [tokens, seqs, pairs, reads, swaps]
    bigger = list(args)
    bigger[which] += extra
    base = cm.step_time(*args[:4], swap_blocks=args[4])
    assert cm.step_time(*bigger[:4], swap_blocks=bigger[4]) >= base
    assert cm.breakdown(*args[:4], swap_blocks=args[4])["total"] == pytest.approx(base)


def test_decode_and_prefill_grow_with_size() -> None:
    cm = llama8b_h100()
    for b in (1, 8, 64, 256):
        assert cm.decode_step_time(b, 4096) > cm.decode_step_time(b, 128)
    for b in (1, 8, 64):
        assert cm.decode_step_time(2 * b, 1024) > cm.decode_step_time(b, 1024)
    prefills = [cm.prefill_time(n) for n in (16, 512, 2048, 8192, 32768)]
    assert prefills == sorted(prefills)


def test_tensor_parallel_speeds_up_70b_and_adds_allreduce() -> None:
    m, hw = get_model_spec("llama-3.1-70b"), get_hardware_spec("h100")
    tp1, tp2, tp4 = (CostModel(m, hw, tp=tp) for tp in (1, 2, 4))
    assert tp4.decode_step_time(64, 1024) < tp2.decode_step_time(64, 1024)
    assert tp2.decode_step_time(64, 1024) < tp1.decode_step_time(64, 1024)
    assert tp2.prefill_time(2048) < tp1.prefill_time(2048)
    assert tp1.breakdown(64, 64, 64 * 1025.0, 64 * 1025)["allreduce"] == 0.0
    assert tp2.breakdown(64, 64, 64 * 1025.0, 64 * 1025)["allreduce"] > 0.0


@pytest.mark.parametrize("field", ["mfu", "mbu", "attn_mfu", "attn_mbu", "host_link_fraction"])
def test_efficiency_fractions_validated(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Efficiency(**{field: 0.0})
    with pytest.raises(ValueError, match="step_overhead_s"):
        Efficiency(step_overhead_s=-1.0)


# --- realistic ballparks (Llama-3.1-8B bf16, one H100 SXM, vLLM-class engine) -------------


def test_decode_batch1_ballpark() -> None:
    # InferenceBench concurrency sweep (yobitelcomm.github.io/bench/recipes/concurrency-sweep):
    # vLLM 0.21, H100, Llama-3.1-8B-Instruct fp16, concurrency 1: TPOT p50 6.48 ms.
    assert 6e-3 <= llama8b_h100().decode_step_time(1, 1024) <= 8e-3


def test_decode_batch64_ballpark() -> None:
    # Roofline: 15 GB weights + 64 x 1k x 128 KiB = 8.6 GB of KV per step at ~75% of
    # 3.35 TB/s is ~9-10 ms plus overhead; the lead's target band is 10-15 ms.
    assert 10e-3 <= llama8b_h100().decode_step_time(64, 1024) <= 15e-3


def test_prefill_2k_ballpark() -> None:
    # 2k tokens x 14 GFLOP/token = 29 TFLOP; Megatron-LM reaches 413-430 TFLOP/s per H100
    # on Llama-3 8B (swiss-ai/Megatron-LM PR #29), so 60-120 ms covers ~25-50% MFU.
    assert 60e-3 <= llama8b_h100().prefill_time(2048) <= 120e-3


def test_70b_tp4_decode_ballpark() -> None:
    # Roofline: 35 GB of weights per GPU at the ~2.5 TB/s the batch-1 decode measurements
    # imply (see test_decode_batch1_ballpark) is ~14 ms, before KV reads and 160 all-reduces.
    cm = CostModel(get_model_spec("llama-3.1-70b"), get_hardware_spec("h100"), tp=4)
    assert 14e-3 <= cm.decode_step_time(64, 1024) <= 25e-3
    assert math.isfinite(cm.prefill_time(8192))
