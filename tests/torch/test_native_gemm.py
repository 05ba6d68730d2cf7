"""kvloop's own CPU integer GEMMs (``executor.torch.native``): ``q4_linear`` through
``Int4Linear`` and ``q8_linear`` through ``Int8Linear`` against float references of the
dequantised weights (exactly, on a 4-bit or Q8_0 grid, once the int8 activation quantisation
is reproduced), ``pack_q8``'s layout, ``make_linear``'s int8 layer (the LM head under int4)
where the kernel tiles, a NaN or inf activation making its row NaN, and bad input refused
with a RuntimeError."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from native_helpers import BF16, KERNELS, OPS, q8_args  # noqa: E402

from kvloop.executor.torch import native  # noqa: E402
from kvloop.executor.torch.linear import (  # noqa: E402
    HEAD_QUANTIZATION,
    DenseLinear,
    Int4Linear,
    Int8Linear,
    int8_runs,
    logits,
    make_linear,
)

F16 = torch.float16


# -- q4_linear ------------------------------------------------------------------------------
def dequantise(w: torch.Tensor) -> torch.Tensor:
    """``Int4Linear``'s 4-bit grid of ``w`` ([N, K], groups of 32 along K: ``scale * code +
    low``, asymmetric min/max, scale and low rounded to float16), in float64."""
    g = w.float().view(w.shape[0], -1, 32)
    low = g.amin(-1, keepdim=True).half().float()
    scale = ((g.amax(-1, keepdim=True) - low) / 15).half().float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).double()
    low, g = low.double(), g.double()
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
    """Whether ``lin`` multiplies through ``q4_linear`` (it then holds float16 ``lows``;
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
    x = rows_with_ties(m, k, gen)
    bias = torch.randn(n, generator=gen).to(BF16)
    y = Int4Linear(w, bias, BF16)(x).double()
    assert_exact_up_to_rounding(y, x, w, bias)
    # Ties rounded away from zero miss by more.
    away = x.float().view(m, -1, 32)
    mx = away.abs().amax(-1, keepdim=True)
    away = torch.trunc(away * (127 / mx) + 0.5 * torch.sign(away)) * (mx / 127)
    assert bf16_steps(y, away.double().view(m, k) @ w.double().t() + bias.double()) > 2


@pytest.mark.skipif(not KERNELS.amx_available(), reason="no AMX-BF16 here (q4_linear keeps "
                    "its VNNI or AVX2 loop)")
@pytest.mark.parametrize("m", [32, 33, 47, 70])
def test_q4_linear_with_amx_is_exact_on_a_4bit_grid(m: int) -> None:
    """From ``AMX_Q4_ROWS`` bfloat16 rows ``q4_linear`` widens its 4-bit weights to bfloat16
    (exact on this grid: small integers times powers of two) and multiplies them with AMX,
    the activations not quantised: with integer activations every sum is exact, so the
    float32 logits are the float64 product plus the bias rounded once, the bfloat16 output
    that rounded again, and the residual add one more rounding of the same sums."""
    assert m >= KERNELS.AMX_Q4_ROWS
    n, k = 48, 192  # NOTE: 3 tiles of outputs: the last one alone
    w = grid_weight(n, k, seed=m)
    gen = torch.Generator().manual_seed(m)
    x = torch.randint(-8, 8, (m, k), generator=gen).to(BF16)
    bias = torch.randn(n, generator=gen)
    lin = Int4Linear(w, bias, BF16)
    want = (x.double() @ w.double().t() + bias.double()).float()
    # Able to fail: a misplaced nibble, scale or offset changes an exact sum.
    assert torch.equal(logits(lin, x), want)
    assert torch.equal(lin(x), want.to(BF16))
    out = torch.randint(-64, 64, (m, n), generator=gen).to(BF16)
    expect = (out.float() + want).to(BF16)
    lin.add_to_(out, x)
    assert torch.equal(out, expect)


def rows_with_ties(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """[m, k] bfloat16 activations whose row 0 holds multiples of 1/32 with a group max of
    127/16, so that x * 127 / max lands on halves: ties, which the kernels round to even."""
    x = torch.randn(m, k, generator=gen)
    halves = torch.randint(-254, 255, (k,), generator=gen) / 2
    halves[::32] = 127.0
    x[0] = halves / 16
    return x.to(BF16)


def bf16_steps(y: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest distance of ``y`` from ``ref``, in bfloat16 steps (2^-8 relative)."""
    return float(((y - ref).abs() / (ref.abs() * 2**-8 + 1e-6)).max())


def assert_exact_up_to_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                                bias: torch.Tensor) -> None:
    """``y`` is the exact product of the int8-quantised ``x`` and the grid weight ``w``
    rounded once to bfloat16 (half a step at most, float32 sums adding ~1e-6 relative; at
    least 98 % the very nearest value), and unquantised activations miss it by more."""
    exact = quantise_rows(x) @ w.double().t() + bias.double()
    assert bf16_steps(y, exact) <= 1.01
    assert float((y == exact.to(BF16).double()).double().mean()) >= 0.98
    assert bf16_steps(y, x.double() @ w.double().t() + bias.double()) > 2


# -- q8_linear ------------------------------------------------------------------------------
def dequantise_q8(w: torch.Tensor) -> torch.Tensor:
    """``Int8Linear``'s 8-bit grid of ``w`` ([N, K], groups of 32 along K: ``scale * code``,
    ``scale = absmax / 127`` rounded to float16, codes in -127..127, llama.cpp's Q8_0), in
    float64."""
    g = w.float().view(w.shape[0], -1, 32)
    scale = (g.abs().amax(-1, keepdim=True) / 127).half().float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (g / scale).round().clamp(-127, 127)
    return (codes.double() * scale.double()).view(w.shape)


def unpack_q8(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes ``[N, K]`` and scales ``[N, K/32]`` of ``pack_q8``'s output,
    read as ``q8_linear.cpp`` documents its layout: per tile of 16 outputs and group of 32
    inputs, chunk c (64 bytes) holds at byte ``4 n + j`` the weight of ``k = 4 c + j``."""
    tiles, groups = scales.shape[:2]
    n, k = tiles * 16, groups * 32
    codes = packed.view(tiles, groups, 8, 16, 4).permute(0, 3, 1, 2, 4).reshape(n, k)
    return codes, scales.transpose(1, 2).reshape(n, groups)


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
    # sum_k (w + 128) a without the "- 128 sum_k a" term: off by 128 d s sum(a) per group,
    # s sum(a) being about the group's sum of x.
    d = (w.view(n, -1, 32).abs().amax(-1) / 127).half().double()  # the weights' scales
    uncorrected = ref + 128 * x.double().view(m, -1, 32).sum(-1) @ d.t()
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
    lin = Int8Linear(w, None)
    packed, scales = lin.packed, lin.scales
    # NOTE: the kernel reads the bytes in order: their count and contiguity matter, not the
    # tensor's shape (pack_q8's docstring says [N/16, K/32, 512]; it returns that as
    # [N/16, K/32, 8, 16, 4]).
    assert packed.dtype == torch.int8 and packed.numel() == n * k and packed.is_contiguous()
    assert packed.shape[:2] == (n // 16, k // 32)
    assert scales.dtype == torch.float16 and scales.shape == (n // 16, k // 32, 16)
    got_codes, got_scale = unpack_q8(packed, scales)
    assert torch.equal(got_codes.long(), codes)
    assert torch.equal(got_scale.float(), scale)
    dequantised = (got_scale.float()[..., None] * got_codes.float().view(n, -1, 32)).view(n, k)
    assert torch.equal(dequantised, w)
    assert torch.equal(dequantise_q8(w), w.double())
    # Off the grid the codes still span -127..127 per group.
    off = torch.randn(n, k, generator=torch.Generator().manual_seed(k)) * 0.05
    lin = Int8Linear(off, None)
    off_codes, off_scale = unpack_q8(lin.packed, lin.scales)
    groups = off_codes.view(n, -1, 32).long()
    assert bool((groups.abs().amax(-1) >= 126).all())  # NOTE: 127 up to the float16 scale
    assert torch.equal(off_scale, (off.view(n, -1, 32).abs().amax(-1) / 127).half())
    # The codes are the nearest against the float16 scale, not against the float32 one.
    off_groups = off.view(n, -1, 32)
    assert torch.equal(groups, (off_groups / off_scale.float()[..., None]).round().clamp(-127, 127)
                       .long())


def test_int8_refuses_weights_beyond_float16() -> None:
    """The LM head under int4 (8 bits, float16 scales as Q8_0's): a group whose scale
    (amax / 127) float16 cannot hold, or a NaN weight, is refused by name."""
    w = torch.randn(16, 64) * 0.02
    w[5, 3] = -1e7  # NOTE: scale 78740, beyond float16's 65504
    with pytest.raises(ValueError, match=r"quantization int8 holds each group's scale as "
                                         r"float16 .*: a weight group's scale is 78740"):
        Int8Linear(w, None)
    w[5, 3] = float("nan")
    with pytest.raises(ValueError, match="a weight group's scale is nan"):
        Int8Linear(w, None)
    with pytest.raises(ValueError, match="pack_q8: scale must hold float16 values"):
        native.pack_q8(torch.zeros(16, 32, dtype=torch.int8), torch.full((16, 1), 0.1))


@pytest.mark.parametrize("m", [1, 4, 6])
def test_q8_linear_is_exact_on_an_8bit_grid(m: int) -> None:
    """Weights on a Q8_0 grid are held exactly: what remains is the int8 activations (here
    reproduced) and the output's rounding."""
    n, k = 64, 192
    w, _, _ = q8_grid_weight(n, k, seed=10 + m)
    gen = torch.Generator().manual_seed(m)
    x = rows_with_ties(m, k, gen)
    bias = torch.randn(n, generator=gen).to(BF16)
    lin = Int8Linear(w, bias)
    y = lin(x).double()
    assert_exact_up_to_rounding(y, x, w, bias)
    assert bf16_steps(y, x.double() @ chunks_reversed(w).double().t() + bias.double()) > 2
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


# -- bad input ------------------------------------------------------------------------------
def _q4_args(m: int = 2, n: int = 32, k: int = 64, **change: object) -> dict[str, object]:
    args: dict[str, object] = {
        "x": torch.randn(m, k).to(BF16),
        "packed": torch.zeros(n // 16, k // 32, 256, dtype=torch.uint8),
        "scales": torch.ones(n // 16, k // 32, 16, dtype=F16),
        "mins": torch.zeros(n // 16, k // 32, 16, dtype=F16),
        "bias": None,
        "out": torch.empty(m, n, dtype=BF16),
        "accumulate": False,
    }
    args.update(change)
    return args


@pytest.mark.parametrize("change, message", [
    ({"x": torch.randn(2, 48).to(BF16), "packed": torch.zeros(32 * 24, dtype=torch.uint8),
      "scales": torch.ones(32, dtype=F16), "mins": torch.zeros(32, dtype=F16)}, "shapes"),
    ({"out": torch.empty(2, 24, dtype=BF16)}, "shapes"),
    ({"out": torch.empty(3, 32, dtype=BF16)}, "shapes"),
    ({"packed": torch.zeros(32 * 16, dtype=torch.uint8)}, "W"),
    ({"scales": torch.ones(2, 2, 16, dtype=BF16)}, "W"),
    ({"mins": torch.zeros(2, 2, 16)}, "W"),
    ({"out": torch.empty(2, 32, dtype=torch.float16)}, "dtypes"),
    ({"bias": torch.zeros(32, dtype=BF16)}, "bias"),
    ({"bias": torch.zeros(16)}, "bias"),
    ({"x": torch.randn(2, 64).half(), "out": torch.empty(2, 32).half()}, "bfloat16 or float32"),
    ({"x": torch.randn(2, 128).to(BF16)[:, ::2]}, "layout"),
], ids=["k-48", "n-24", "m-out", "packed-size", "scales-dtype", "mins-float32", "out-dtype",
        "bias-dtype", "bias-size", "float16", "strided-x"])
def test_q4_linear_refuses_bad_input(change: dict[str, object], message: str) -> None:
    OPS.q4_linear(**_q4_args())  # the unchanged arguments run
    with pytest.raises(RuntimeError, match=message):
        OPS.q4_linear(**_q4_args(**change))


@pytest.mark.parametrize("name", ["packed", "scales", "mins", "bias"])
def test_q4_linear_refuses_strided_weights(name: str) -> None:
    strided = {  # NOTE: each read as contiguous stays inside its storage: no crash
        "packed": torch.zeros(2, 2, 512, dtype=torch.uint8)[..., ::2],
        "scales": torch.ones(2, 2, 32, dtype=F16)[..., ::2],
        "mins": torch.zeros(2, 2, 32, dtype=F16)[..., ::2],
        "bias": torch.arange(64.0)[::2],
    }[name]
    with pytest.raises(RuntimeError):
        OPS.q4_linear(**_q4_args(**{name: strided}))



@pytest.mark.parametrize("change, message", [
    ({"x": torch.randn(2, 48).to(BF16), "packed": torch.zeros(32 * 48, dtype=torch.int8),
      "scales": torch.ones(48)}, "shapes"),
    ({"out": torch.empty(2, 24, dtype=BF16)}, "shapes"),
    ({"out": torch.empty(3, 32, dtype=BF16)}, "shapes"),
    ({"packed": torch.zeros(32 * 16, dtype=torch.int8)}, "W"),
    ({"packed": torch.zeros(2, 2, 512, dtype=torch.uint8)}, "W"),
    ({"scales": torch.ones(2, 2, 16, dtype=BF16)}, "W"),
    ({"scales": torch.ones(2, 2, 16)}, "W"),
    ({"scales": torch.ones(2, 1, 16, dtype=torch.float16)}, "W"),
    ({"packed": torch.zeros(2, 2, 1024, dtype=torch.int8)[..., ::2]}, "contiguous"),
    ({"scales": torch.ones(2, 2, 32, dtype=torch.float16)[..., ::2]}, "contiguous"),
    ({"out": torch.empty(2, 32, dtype=torch.float16)}, "dtypes"),
    ({"bias": torch.zeros(32, dtype=BF16)}, "bias"),
    ({"bias": torch.zeros(16)}, "bias"),
    ({"bias": torch.arange(64.0)[::2]}, "bias"),
    ({"x": torch.randn(2, 64).half(), "out": torch.empty(2, 32).half()}, "bfloat16 or float32"),
    ({"x": torch.randn(2, 128).to(BF16)[:, ::2]}, "layout"),
    ({"out": torch.empty(2, 64, dtype=BF16)[:, ::2]}, "layout"),
    ({"x": torch.randn(2, 1, 64).to(BF16)}, "layout"),
], ids=["k-48", "n-24", "m-out", "packed-size", "packed-uint8", "scales-dtype", "scales-float32",
        "scales-size", "strided-packed", "strided-scales", "out-dtype",
        "bias-dtype", "bias-size", "strided-bias", "float16", "strided-x", "strided-out",
        "x-3d"])
def test_q8_linear_refuses_bad_input(change: dict[str, object], message: str) -> None:
    OPS.q8_linear(**q8_args())  # the unchanged arguments run
    with pytest.raises(RuntimeError, match=message):
        OPS.q8_linear(**q8_args(**change))


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


@pytest.mark.parametrize("m", [1, 3, 6, 17])
@pytest.mark.parametrize("kind", ["bf16", "int8", "int4", "dense"])
def test_logits_are_the_float32_sums_rounded_once(kind: str, m: int) -> None:
    """``linear.logits``: kvloop's kernels write an LM head's float32 sums (+ bias) straight
    to float32 for bfloat16 activations: the same sums as their bfloat16 output, which is
    that rounded once, at float32's resolution (close logits stay apart). Other layouts widen
    their own product."""
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(160, 96, generator=gen) * 0.3
    bias = None if kind in ("int8", "dense") else torch.randn(160, generator=gen)
    if kind == "bf16" and not native.bf16_supported():
        pytest.skip("bf16_linear does not run here")
    head = {"bf16": lambda: make_linear(w.to(BF16), None if bias is None else bias.to(BF16)),
            "int8": lambda: make_linear(w, None, quantization="int8", dtype=BF16),
            "int4": lambda: make_linear(w, bias, quantization="int4", dtype=BF16),
            "dense": lambda: DenseLinear(w.to(BF16), None)}[kind]()
    x = torch.randn(m, 96, generator=gen).to(BF16)
    got = logits(head, x)
    assert got.dtype == torch.float32 and got.shape == (m, 160)
    if kind == "dense":
        assert torch.equal(got, head(x).float())
        return
    # Able to fail: a kernel that rounded to bfloat16 first would hold only bfloat16 values.
    assert torch.equal(got.to(BF16), head(x)), "the same sums, rounded once"
    assert not torch.equal(got, got.to(BF16).float()), "float32 values, not bfloat16 ones"
