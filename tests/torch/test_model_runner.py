"""The torch model runner driven by the real scheduler: greedy output token-identical to
transformers ``generate`` across batching, chunking, prefix hits, preemption and arrivals."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import (
    TinyModel,
    assert_matches,
    build_tiny,
    drive,
    llama_config,
    make_runner,
    prompts_of,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvloop.executor.torch import KVCache, native  # noqa: E402
from kvloop.executor.torch import attention as attn_mod  # noqa: E402
from kvloop.executor.torch.flex import flex_paged_attention  # noqa: E402
from kvloop.executor.torch.models.llama import rope_inv_freq  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # type: ignore[no-untyped-def]
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine
    every multi-threaded op waits for a descheduled thread: run this module on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- greedy equivalence under every scheduling situation ------------------------------------
def test_single_request(tiny: TinyModel, device: str) -> None:
    runner = make_runner(tiny, device)
    reqs, s = drive(runner, prompts_of([11], tiny.vocab_size), 16)
    assert_matches(tiny, reqs, 16)
    # Finished ids reach the runner with the next step, which may be empty.
    out = s.schedule()
    assert out.is_empty and out.finished_request_ids == ["r0"]
    assert runner.execute(out).sampled_token_ids == {}
    assert not runner.requests, "finished request state was not dropped"


def test_batch_of_different_lengths(tiny: TinyModel, device: str) -> None:
    runner = make_runner(tiny, device, max_num_batched_tokens=128)
    reqs, s = drive(runner, prompts_of([3, 17, 8, 30, 1, 12], tiny.vocab_size, seed=1), 10)
    assert_matches(tiny, reqs, 10)
    assert s.stats.num_steps < 15, "the batch was not run together"


def test_equal_length_batch(llama_model: TinyModel, device: str) -> None:
    runner = make_runner(llama_model, device)
    reqs, _ = drive(runner, prompts_of([9, 9, 9, 9], llama_model.vocab_size, seed=2), 8)
    assert_matches(llama_model, reqs, 8)


def test_chunked_prefill_tiny_budget(tiny: TinyModel, device: str) -> None:
    runner = make_runner(tiny, device, max_num_batched_tokens=8, max_num_seqs=4)
    prompts = prompts_of([21, 13, 30, 5], tiny.vocab_size, seed=3)
    reqs, s = drive(runner, prompts, 8, max_model_len=64, enable_chunked_prefill=True)
    assert_matches(tiny, reqs, 8)
    assert s.stats.num_steps > sum(map(len, prompts)) // 8, "prompts were not chunked"


def test_prefix_cache_hit(tiny: TinyModel, device: str) -> None:
    runner = make_runner(tiny, device)
    base = prompts_of([24], tiny.vocab_size, seed=4)[0]
    prompts = [
        base,
        [*base[:21], 7, 8, 9, 10],  # five cached blocks, then its own tokens
        [*base[:8], 11],  # two cached blocks and a single token to compute
    ]
    reqs, s = drive(runner, prompts, 12, arrive_at=[0, 3, 5])
    assert_matches(tiny, reqs, 12)
    assert s.stats.prefix_cache_hits >= 20 + 8, "the scheduler reported no prefix-cache hits"


def test_preemption_by_recompute(tiny: TinyModel, device: str) -> None:
    runner = make_runner(tiny, device, num_gpu_blocks=14)
    prompts = prompts_of([10, 7, 12, 9], tiny.vocab_size, seed=5)
    reqs, s = drive(runner, prompts, 20, preemption_mode="recompute")
    assert_matches(tiny, reqs, 20)
    assert s.stats.num_recompute_preemptions > 0


def test_preemption_by_swap(tiny: TinyModel, device: str) -> None:
    runner = make_runner(tiny, device, num_gpu_blocks=14, num_cpu_blocks=32)
    prompts = prompts_of([10, 7, 12, 9], tiny.vocab_size, seed=6)
    reqs, s = drive(runner, prompts, 20, preemption_mode="swap")
    assert_matches(tiny, reqs, 20)
    assert s.stats.num_swap_preemptions > 0
    assert s.stats.num_blocks_swapped_in > 0


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_serves_like_transformers(llama_model: TinyModel, device: str) -> None:
    """The in-place (FlexAttention) path through the whole loop: chunked prompts, a shared
    cached prefix, decodes and swap preemption give transformers' greedy tokens."""
    runner = make_runner(
        llama_model, device, num_gpu_blocks=12, num_cpu_blocks=32, max_num_batched_tokens=16,
        flex_attention=True,
    )
    base = prompts_of([22], llama_model.vocab_size, seed=8)[0]
    prompts = [base, [*base[:17], 5, 6], *prompts_of([9, 14], llama_model.vocab_size, seed=9)]
    reqs, s = drive(runner, prompts, 14, arrive_at=[0, 3, 4, 6], preemption_mode="swap")
    assert_matches(llama_model, reqs, 14)
    assert s.stats.prefix_cache_hits > 0 and s.stats.num_swap_preemptions > 0


def test_requests_arriving_while_others_decode(tiny: TinyModel, device: str) -> None:
    runner = make_runner(tiny, device, max_num_batched_tokens=16)
    prompts = prompts_of([6, 25, 3, 14, 9], tiny.vocab_size, seed=7)
    reqs, _ = drive(runner, prompts, 12, arrive_at=[0, 2, 4, 5, 9])
    assert_matches(tiny, reqs, 12)


def test_split_attention_groups(
    llama_model: TinyModel, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Free extra groups: every step splits its decodes and prefills as far as allowed."""
    monkeypatch.setattr(attn_mod, "_GROUP_OVERHEAD", 0)
    seen: list[int] = []
    original = attn_mod.build_metadata

    def spy(**kwargs):  # type: ignore[no-untyped-def]
        meta, positions = original(**kwargs)
        seen.append(len(meta.groups))
        return meta, positions

    monkeypatch.setattr("kvloop.executor.torch.model_runner.build_metadata", spy)
    runner = make_runner(llama_model, device, max_num_batched_tokens=40)
    runner.native_attention = False  # NOTE: kvloop's decode kernel takes all decodes at once
    prompts = prompts_of([6, 25, 3, 14, 9, 30, 2], llama_model.vocab_size, seed=13)
    reqs, _ = drive(runner, prompts, 10, arrive_at=[0, 1, 1, 2, 5, 6, 6])
    assert_matches(llama_model, reqs, 10)
    assert max(seen) >= 4


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize(("overhead", "flex"), [(512, False), (0, False), (0, True)])
def test_paged_attention_matches_dense(
    device: str, overhead: int, flex: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both attention paths (gather, and FlexAttention reading the blocks in place) against
    a dense reference, on decodes and prefill chunks with cached prefixes; requests r1 and
    r5 share their first block, as a cached prefix does."""
    monkeypatch.setattr(attn_mod, "_GROUP_OVERHEAD", overhead)
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    heads, kv, d, bs = 4, 2, 8, 4
    # (start, length): decodes first, then prefill chunks, each sorted by context
    reqs = [(2, 1), (8, 1), (16, 1), (40, 1), (0, 5), (8, 3), (20, 12)]
    tables, free = [], torch.randperm(64, generator=gen).tolist()
    for start, n in reqs:
        need = -(-(start + n) // bs)
        tables.append([free.pop() for _ in range(need)])
    tables[5][0] = tables[1][0]
    meta, positions = attn_mod.build_metadata(
        starts=[r[0] for r in reqs],
        lengths=[r[1] for r in reqs],
        block_tables=tables,
        num_decodes=4,
        block_size=bs,
        device=dev,
        dtype=torch.float32,
        flex_pool_blocks=64 if flex else None,
    )
    assert len(meta.groups) >= (2 if overhead == 0 else 1)
    cache = torch.zeros(2, 64, bs, kv, d, device=dev)
    dense = [torch.randn(2, s + n, kv, d, generator=gen).to(dev) for s, n in reqs]
    dense[5][:, :bs] = dense[1][:, :bs]  # the shared block holds the same K/V
    for (start, _), table, kvs in zip(reqs, tables, dense, strict=True):
        for p in range(start):  # the already cached context
            cache[:, table[p // bs], p % bs] = kvs[:, p]
    new_k = torch.cat([kvs[0, s:] for (s, _), kvs in zip(reqs, dense, strict=True)])
    new_v = torch.cat([kvs[1, s:] for (s, _), kvs in zip(reqs, dense, strict=True)])
    attn_mod.write_kv(cache, new_k, new_v, meta.slot_mapping)
    q = torch.randn(len(positions), heads, d, generator=gen).to(dev)
    attend = flex_paged_attention if flex else attn_mod.paged_attention
    out = attend(q, cache, meta, d**-0.5)
    row = 0
    for (start, n), kvs in zip(reqs, dense, strict=True):
        for t in range(n):
            keys, values = kvs[:, : start + t + 1].repeat_interleave(heads // kv, dim=2)
            w = torch.einsum("hd,lhd->hl", q[row], keys).mul(d**-0.5).softmax(-1)
            ref = torch.einsum("hl,lhd->hd", w, values).reshape(-1)
            torch.testing.assert_close(out[row], ref, atol=1e-5, rtol=1e-5)
            assert positions[row].item() == start + t
            row += 1


def test_logprobs_match_transformers(llama_model: TinyModel, device: str) -> None:
    runner = make_runner(llama_model, device)
    prompts = prompts_of([7, 15], llama_model.vocab_size, seed=8)
    seen: dict[str, list[dict[int, float]]] = {}
    original = runner.execute

    def recording(out):  # type: ignore[no-untyped-def]
        result = original(out)
        for rid, lps in (result.logprobs or {}).items():
            seen.setdefault(rid, []).extend(lps)
        return result

    runner.execute = recording  # type: ignore[method-assign]
    reqs, _ = drive(runner, prompts, 6, logprobs=3)
    assert_matches(llama_model, reqs, 6)
    for r in reqs:
        ref = torch.log_softmax(llama_model.logits(list(r.prompt_token_ids), 6), dim=-1)
        assert len(seen[r.request_id]) == 6
        for step, lp in enumerate(seen[r.request_id]):
            top = ref[step].topk(3).indices.tolist()
            assert set(top) | {r.output_token_ids[step]} == set(lp)
            for tok, value in lp.items():
                assert value == pytest.approx(ref[step, tok].item(), abs=1e-4)


# -- models and loading ------------------------------------------------------------------------
def test_unknown_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError) as err:
        make_runner(TinyModel(tmp_path, None))
    assert str(err.value) == (
        "unsupported architecture 'GPT2LMHeadModel'; kvloop supports: "
        "LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, "
        "Qwen3ForCausalLM, Qwen3MoeForCausalLM"
    )


@pytest.mark.parametrize(
    "scaling",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        {"rope_type": "linear", "factor": 2.0},
    ],
    ids=["llama3", "linear"],
)
def test_rope_scaling_matches_transformers(
    tmp_path: Path, scaling: dict[str, object], device: str
) -> None:
    model = build_tiny(tmp_path, llama_config(rope_scaling=scaling, rope_theta=10000.0), seed=3)
    runner = make_runner(model, device)
    hf_inv = model.hf.model.rotary_emb.inv_freq  # type: ignore[attr-defined]
    assert torch.equal(rope_inv_freq(runner.model_config), hf_inv.cpu())
    reqs, _ = drive(runner, prompts_of([40, 9], model.vocab_size, seed=9), 12)
    assert_matches(model, reqs, 12)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rope_tables_grow_to_the_same_bits(tiny: TinyModel, device: str, dtype: str) -> None:
    """RoPE's rows come from tables grown by doubling: each row, before and after a growth,
    is the bits of computing cos and sin for its position alone (float32, then cast)."""
    model = make_runner(tiny, device, dtype=dtype).model
    inv, dt = model.inv_freq, getattr(torch, dtype)

    def direct(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * inv[None, :]
        sin = freqs.sin().to(dt)
        return torch.cat((freqs, freqs), dim=-1).cos().to(dt), torch.cat((-sin, sin), dim=-1)

    sizes = []
    for top in (5, 300, 301, 1000, 3000):
        positions = torch.tensor([0, top // 2, top - 1], device=model.device)
        cos, sin = model.rope(positions, top)
        sizes.append(model._rope_cos.shape[0])
        want_cos, want_sin = direct(positions)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert sizes == [256, 512, 512, 1024, 3000]


def test_sharded_safetensors_with_index(tmp_path: Path, device: str) -> None:
    model = build_tiny(tmp_path, llama_config(), max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    runner = make_runner(model, device)
    reqs, _ = drive(runner, prompts_of([12, 5], model.vocab_size, seed=10), 8)
    assert_matches(model, reqs, 8)


def test_mistral_and_sliding_window(tmp_path: Path, device: str) -> None:
    config = transformers.MistralConfig(**{**llama_config().to_dict(), "sliding_window": None})
    model = build_tiny(tmp_path / "plain", config)
    runner = make_runner(model, device)
    assert runner.model_config.architecture == "MistralForCausalLM"
    reqs, _ = drive(runner, prompts_of([14, 3], model.vocab_size, seed=11), 8)
    assert_matches(model, reqs, 8)
    windowed = transformers.MistralConfig(**{**config.to_dict(), "sliding_window": 16})
    small = build_tiny(tmp_path / "windowed", windowed)
    assert make_runner(small, device).max_model_len == 16
    with pytest.raises(ValueError, match="sliding-window"):
        make_runner(small, device, max_model_len=64)


def test_bfloat16_runs(llama_model: TinyModel, device: str) -> None:
    runner = make_runner(llama_model, device, dtype="bfloat16")
    assert runner.kv_cache.gpu.dtype == torch.bfloat16
    assert runner.model.embed.dtype == torch.bfloat16
    prompts = prompts_of([10, 4], llama_model.vocab_size, seed=12)
    reqs, _ = drive(runner, prompts, 8)
    for r in reqs:
        assert len(r.output_token_ids) == 8
        assert all(0 <= t < llama_model.vocab_size for t in r.output_token_ids)
        # The first token comes from the prompt alone: bf16 agrees with fp32 on it here.
        assert r.output_token_ids[0] == llama_model.greedy(list(r.prompt_token_ids), 8)[0]


def test_blocks_from_memory_budget(llama_model: TinyModel,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = llama_model.hf.config  # type: ignore[attr-defined]
    runner = make_runner(llama_model, num_gpu_blocks=None, kv_cache_memory=1 << 20)
    per_block = 2 * cfg.num_hidden_layers * 4 * cfg.num_key_value_heads * 16 * 4
    layers = cfg.num_hidden_layers
    if runner.native_attention or runner.flex_attention:  # reads the blocks in place
        assert runner.num_gpu_blocks == (1 << 20) // per_block
    else:  # keeps room for the gathered copy of two layers
        assert runner.num_gpu_blocks == (1 << 20) * layers // (layers + 2) // per_block
    with monkeypatch.context() as patch:
        patch.setattr(native, "attention_supported", lambda *args: False)
        gather = make_runner(llama_model, num_gpu_blocks=None, kv_cache_memory=1 << 20)
    assert not gather.native_attention and not gather.flex_attention
    assert gather.num_gpu_blocks == (1 << 20) * layers // (layers + 2) // per_block
    swap = make_runner(llama_model, num_cpu_blocks=None, swap_space_bytes=10 * per_block + 1)
    assert swap.num_cpu_blocks == 10 and swap.kv_cache.cpu.shape[2] == 10
    assert runner.model_config.eos_token_ids == (2,)
    assert runner.model_config.vocab_size == 512


# -- the cache's block copies --------------------------------------------------------------------
def test_kv_cache_swap(device: str) -> None:
    cache = KVCache(
        num_layers=2,
        num_kv_heads=2,
        head_dim=4,
        block_size=3,
        num_gpu_blocks=6,
        num_cpu_blocks=4,
        dtype=torch.float32,
        device=torch.device(device),
    )
    cache.gpu.copy_(torch.randn_like(cache.gpu))
    before = cache.gpu.cpu().clone()
    cache.swap_out([(1, 3), (4, 0)])
    assert torch.equal(cache.cpu[:, :, 3], before[:, :, 1])
    assert torch.equal(cache.cpu[:, :, 0], before[:, :, 4])
    cache.gpu.zero_()
    cache.swap_in([(3, 5), (0, 2)])
    after = cache.gpu.cpu()
    assert torch.equal(after[:, :, 5], before[:, :, 1])
    assert torch.equal(after[:, :, 2], before[:, :, 4])


def test_device_pool_is_zero_and_host_pool_takes_memory_on_demand() -> None:
    statm = Path("/proc/self/statm")

    def resident() -> int:
        return int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = resident() if statm.is_file() else 0
    cache = KVCache(
        num_layers=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        num_gpu_blocks=8,
        num_cpu_blocks=16384,  # 1 GiB of host blocks
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    assert cache.cpu.numel() * 4 == 1 << 30
    assert not cache.gpu.any()
    if statm.is_file():
        grew = resident() - before
        assert grew < 64 << 20, f"1 GiB of swap space made {grew >> 20} MiB resident up front"
    cache.gpu.copy_(torch.randn_like(cache.gpu))
    cache.swap_out([(3, 16000)])
    cache.swap_in([(16000, 5)])
    assert torch.equal(cache.gpu[:, :, 5], cache.gpu[:, :, 3])


# -- config parsing ------------------------------------------------------------------------------
def test_config_parsing_transformers4_layout() -> None:
    from kvloop.executor.torch import ModelConfig

    base = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 100,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "eos_token_id": [5, 6],
        "max_position_embeddings": 131072,
    }
    cfg = ModelConfig.from_dict(base, {"eos_token_id": [6, 7]})
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is not None
    assert cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.num_kv_heads == 4 and cfg.head_dim == 16
    assert cfg.eos_token_ids == (5, 6, 7) and cfg.eos_token_id == 5
    assert ModelConfig.from_dict({**base, "rope_scaling": None}).rope_scaling is None
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096}
    assert ModelConfig.from_dict({**qwen, "use_sliding_window": False}).sliding_window is None
    on = ModelConfig.from_dict({**qwen, "use_sliding_window": True, "max_window_layers": 1})
    assert on.sliding_window == 4096 and on.qkv_bias and not on.o_bias
    no_arch = {k: v for k, v in base.items() if k != "architectures"}
    assert ModelConfig.from_dict({**no_arch, "model_type": "mistral"}).architecture == (
        "MistralForCausalLM"
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_rms_norm_is_transformers_bit_for_bit(dtype: str) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from kvloop.executor.torch.layer_ops import rms_norm

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(9, 96, generator=g) * 4).to(dt)
    ref = LlamaRMSNorm(96, eps=1e-5).to(dt)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(96, generator=g))
        assert torch.equal(rms_norm(x, ref.weight, 1e-5), ref(x))
