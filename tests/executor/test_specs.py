"""Model and hardware specs: shapes, presets, JSON hardware specs, KV-pool sizing."""

from __future__ import annotations

import json

import pytest

from kvloop.executor.simulated.specs import (
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    GiB,
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
    for name in ("a100-80gb", "a40", "h100", "h200", "l4", "l40s", "b200", "rtx-4090",
                 "rtx-pro-6000"):
        assert get_hardware_spec(name) is HARDWARE_PRESETS[name]
        assert get_hardware_spec(name.upper()) is HARDWARE_PRESETS[name]


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
    with pytest.raises(ValueError, match="a100-80gb, a40, h100, h200, b200, l4, l40s, rtx-4090, "
                       "rtx-pro-6000"):
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




# --- JSON hardware specs (--gpu PATH) ---------------------------------------------------

SPEC = {
    "name": "my-gpu",
    "peak_flops": 400e12,
    "mem_bandwidth": 2.0e12,
    "mem_bytes": 48 * GiB,
    "host_link_bandwidth": 64e9,
    "interconnect": "pcie5",
}


def test_json_hardware_spec_loads_with_derived_or_named_profile(tmp_path) -> None:
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(SPEC))
    hw = get_hardware_spec(str(path))
    assert hw.name == "my-gpu" and hw.profile == "derived"
    assert hw.efficiency().source.startswith("derived")
    path.write_text(json.dumps({**SPEC, "profile": "h100"}))
    assert get_hardware_spec(str(path)).efficiency() == get_hardware_spec("h100").efficiency()


def test_json_hardware_spec_with_explicit_efficiency(tmp_path) -> None:
    eff = get_hardware_spec("h100").efficiency().to_dict()
    eff["gemm"]["compute_fraction"] = 0.5
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({**SPEC, "profile": eff}))
    assert get_hardware_spec(str(path)).efficiency().gemm.compute_fraction == 0.5


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"peak_flops": -1}, "peak_flops must be a positive number"),
        ({"mem_bandwidth": "fast"}, "mem_bandwidth must be a positive number"),
        ({"interconnect": "carrier-pigeon"}, "unknown interconnect"),
        ({"profile": "b200"}, "no shipped efficiency profile 'b200'"),
        ({"profile": {"gemm": {}}}, "missing key"),
        ({"colour": "green"}, "unknown key(s) colour"),
    ],
)
def test_bad_json_hardware_spec_names_the_problem(tmp_path, change, needle) -> None:
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({**SPEC, **change}))
    with pytest.raises(ValueError) as err:
        get_hardware_spec(str(path))
    assert needle in str(err.value)


def test_missing_key_and_unreadable_spec(tmp_path) -> None:
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({k: v for k, v in SPEC.items() if k != "mem_bytes"}))
    with pytest.raises(ValueError, match=r"missing key.*mem_bytes"):
        get_hardware_spec(str(path))
    path.write_text("[1, 2")
    with pytest.raises(ValueError, match="not a readable JSON hardware spec"):
        get_hardware_spec(str(path))
