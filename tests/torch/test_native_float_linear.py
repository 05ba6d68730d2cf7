"""kvloop's float GEMMs (``native.bf16_linear`` and ``native.f32_linear``; ``linear.Bf16Linear``
and ``linear.F32Linear``): exact where the float32 sums are exact (integer-valued operands),
torch's product up to the order of its float32 sums elsewhere, the residual add rounded
once, ``make_linear`` choosing them only where they run, a NaN activation poisoning its row
only, and bad input refused with a RuntimeError (a ValueError naming the matrix from the
layer classes)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from native_helpers import BF16, KERNELS, OPS  # noqa: E402

from kvloop.executor.torch import native  # noqa: E402
from kvloop.executor.torch.linear import (  # noqa: E402
    Bf16Linear,
    F32Linear,
    float_kernel_runs,
    make_linear,
)

F32 = torch.float32
KINDS = [
    pytest.param(Bf16Linear, marks=pytest.mark.skipif(
        not native.bf16_supported(),
        reason="bf16_linear does not run here (the full build without AVX-512 BF16)")),
    F32Linear,
]
SHAPES = [(16, 32), (48, 96), (64, 256), (160, 64)]


def integers(*shape: int, gen: torch.Generator, dtype: torch.dtype, span: int = 8) -> torch.Tensor:
    """Integers in [-span, span) (exact in bfloat16 and float32): their products and sums
    stay exact in float32, so a right kernel matches the float64 reference to the bit."""
    return torch.randint(-span, span, shape, generator=gen).to(dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 17])
def test_float_linear_is_exact_on_integers(kind: type, m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x = integers(n, k, gen=gen, dtype=kind.dtype), integers(m, k, gen=gen, dtype=kind.dtype)
    bias = integers(n, gen=gen, dtype=kind.dtype)
    lin = kind(w, bias)
    ref = x.double() @ w.double().t() + bias.double()
    # Able to fail: any misplaced weight or input changes an integer sum.
    assert torch.equal(lin(x), ref.to(kind.dtype))
    out = integers(m, n, gen=gen, dtype=kind.dtype, span=64)
    want = (out.double() + ref).to(kind.dtype)
    lin.add_to_(out, x)
    assert torch.equal(out, want), "the residual add is rounded once, with the product"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 4, 6, 33])
def test_float_linear_is_torchs_product(kind: type, m: int) -> None:
    """Random values: within a rounding step or two of torch's own product (which sums in
    another order), and close to the float64 reference."""
    gen = torch.Generator().manual_seed(m)
    w = (torch.randn(96, 128, generator=gen) * 0.05).to(kind.dtype)
    x = torch.randn(m, 128, generator=gen).to(kind.dtype)
    bias = torch.randn(96, generator=gen).to(kind.dtype)
    y = kind(w, bias)(x)
    ref = x.double() @ w.double().t() + bias.double()
    tol = {"atol": 2e-2, "rtol": 1e-2} if kind.dtype == BF16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(y.double(), ref, **tol)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, bias), **tol)
    # A strided input (the gate half of a fused gate/up output) is accepted (made contiguous).
    wide = torch.randn(m, 256, generator=gen).to(kind.dtype)
    strided = kind(w, None)(wide[:, :128])
    assert torch.equal(strided, kind(w, None)(wide[:, :128].contiguous()))
    torch.testing.assert_close(strided, torch.nn.functional.linear(wide[:, :128], w), **tol)


def order_sensitive(n: int, k: int, m: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """bfloat16 ``w`` [n, k] and ``x`` [m, k] whose float32 sums depend on their order: each
    output has +2^24, 1 and -2^24 at three random inputs (2^24 + 1 rounds to 2^24 in float32,
    so where the ones cancel, the order decides whether the 1 survives), each row random
    signs."""
    w = torch.zeros(n, k)
    for row in w:
        a, b, c = torch.randperm(k, generator=gen)[:3].tolist()
        row[a], row[b], row[c] = 2.0 ** 24, 1.0, -(2.0 ** 24)
    x = torch.randint(0, 2, (m, k), generator=gen).float() * 2 - 1
    return w.to(BF16), x.to(BF16)


@pytest.mark.skipif(KERNELS.__name__ != native.AVX2.name,
                    reason="the AVX2 build's bf16_linear (the full one has vdpbf16ps)")
@pytest.mark.parametrize("m", [9, 17, 30, 64])
def test_avx2_bf16_linear_rows_are_the_same_bits_widened_once_or_as_read(m: int) -> None:
    """Above 8 rows the AVX2 ``bf16_linear`` widens each tile once into a thread's scratch;
    up to 8 it widens the weights as it reads them. Both sum in the same order, so every row
    is the same bits as in calls of at most 4 rows (passes of 4 from row 0, the rest in one):
    a prompt's logits do not move with the change, nor with the number of rows in a call.
    The weights make the order show (``order_sensitive``), and shapes alternate between
    calls, so a copy left from another matrix (another K, another tile) would show too."""
    gen = torch.Generator().manual_seed(m)
    mats = [order_sensitive(n, k, m, gen) for n, k in [(160, 96), (48, 256)]]
    for _ in range(2):
        for w, x in mats:
            lin = Bf16Linear(w, None)
            y = lin(x)
            assert torch.equal(y, torch.cat([lin(x[i:i + 4]) for i in range(0, m, 4)]))


@pytest.mark.skipif(not KERNELS.amx_available(), reason="no AMX-BF16 here (bf16_linear keeps "
                    "its vdpbf16ps or AVX2 loop)")
@pytest.mark.parametrize("m", [4, 15, 16, 17, 31, 32, 33, 47, 70])
def test_amx_bf16_linear_is_exact_and_stays_in_its_rows(m: int) -> None:
    """From ``AMX_ROWS`` rows ``bf16_linear`` multiplies with AMX tiles of 16 rows and 16
    outputs: exact on integers for every row count (a last, partial block of rows padded
    with zeros; an odd tile count of outputs, 48, as a last single tile), with the bias and
    the residual add, and nothing written past the call's rows."""
    assert m >= KERNELS.AMX_ROWS
    gen = torch.Generator().manual_seed(m)
    for n, k in [(48, 96), (160, 64), (64, 544)]:
        w, x = integers(n, k, gen=gen, dtype=BF16), integers(m, k, gen=gen, dtype=BF16)
        bias = integers(n, gen=gen, dtype=BF16)
        lin = Bf16Linear(w, bias)
        ref = x.double() @ w.double().t() + bias.double()
        buffer = torch.full((m + 3, n), 7.0, dtype=BF16)
        out = buffer[:m]
        out.copy_(integers(m, n, gen=gen, dtype=BF16, span=64))
        want = (out.double() + ref).to(BF16)
        lin.add_to_(out, x)
        assert torch.equal(out, want)
        assert torch.equal(lin(x), ref.to(BF16))
        assert bool((buffer[m:] == 7.0).all()), "rows past the call's are untouched"


def test_pack_layouts() -> None:
    """bfloat16 ``[N/16, K/2, 16, 2]``: the pair of inputs (2p, 2p + 1) of output 16 t + i at
    ``[t, p, i]``; float32 ``[N/16, K, 16]``: input k of output 16 t + i at ``[t, k, i]``."""
    w = torch.arange(32 * 64, dtype=torch.float32).view(32, 64)
    p = native.pack_bf16(w.to(BF16))
    assert p.shape == (2, 32, 16, 2) and p.is_contiguous()
    assert torch.equal(p[1, 5, 3], w[16 + 3, 10:12].to(BF16))
    p = native.pack_f32(w)
    assert p.shape == (2, 64, 16) and p.is_contiguous()
    assert torch.equal(p[1, 5], w[16:, 5]) and p[1, 5, 3] == w[19, 5]


def test_make_linear_picks_the_float_kernels_where_they_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(1)
    bf16 = native.bf16_supported()
    f32 = native.f32_preferred()
    assert f32 is (KERNELS.__name__ == native.AVX2.name), "measured faster on AVX2 only"
    for n, k, tiles in [(48, 64, True), (24, 64, False), (48, 48, False)]:
        w = torch.randn(n, k, generator=gen)
        assert float_kernel_runs(w) is tiles
        assert isinstance(make_linear(w, None), F32Linear) is (tiles and f32), (n, k)
        assert float_kernel_runs(w.to(BF16)) is (tiles and bf16)
        assert isinstance(make_linear(w.to(BF16), None), Bf16Linear) is (tiles and bf16)
    w = torch.randn(48, 64, generator=gen)
    assert not float_kernel_runs(w.half()), "float16 keeps torch's kernels"
    with pytest.raises(ValueError, match="Bf16Linear needs"):
        Bf16Linear(w, None)
    with pytest.raises(ValueError, match="F32Linear needs"):
        F32Linear(w.to(BF16), None)
    if KERNELS.__name__ == native.FULL.name:
        with monkeypatch.context() as patch:  # a CPU with VNNI but without AVX-512 BF16
            patch.setattr(native, "cpu_flags", lambda: frozenset({"avx512_vnni"}))
            assert not native.bf16_supported()
            assert not isinstance(make_linear(w.to(BF16), None), Bf16Linear)
            assert float_kernel_runs(w), "float32 needs only FMA"
    with monkeypatch.context() as patch:  # NOTE: native.kernels is cached: patch the name
        patch.setattr(native, "kernels", lambda: None)
        assert not float_kernel_runs(w.to(BF16)) and not float_kernel_runs(w)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_float_linear_propagates_non_finite_activations(kind: type, bad: float) -> None:
    gen = torch.Generator().manual_seed(5)
    lin = kind(torch.randn(32, 96, generator=gen).to(kind.dtype), None)
    x = torch.randn(3, 96, generator=gen).to(kind.dtype)
    x[1, 40] = bad
    y = lin(x)
    assert not y[1].isfinite().any()
    assert y[0].isfinite().all() and y[2].isfinite().all()


def _args(dtype: torch.dtype, m: int = 2, n: int = 32, k: int = 64,
          **change: object) -> dict[str, object]:
    packed = (torch.zeros(n // 16, k // 2, 16, 2, dtype=BF16) if dtype == BF16
              else torch.zeros(n // 16, k, 16))
    args: dict[str, object] = {
        "x": torch.randn(m, k).to(dtype),
        "packed": packed,
        "bias": None,
        "out": torch.empty(m, n, dtype=dtype),
        "accumulate": False,
    }
    args.update(change)
    return args


COMMON_BAD = [  # (change given the dtype, message)
    (lambda d: {"x": torch.randn(2, 48).to(d)}, "shapes"),
    (lambda d: {"out": torch.empty(3, 32, dtype=d)}, "shapes"),
    (lambda d: {"out": torch.empty(2, 24, dtype=d)}, "shapes"),
    (lambda d: {"x": torch.randn(64, 2).to(d).t()}, "layout"),
    (lambda d: {"bias": torch.zeros(31)}, "bias"),
    (lambda d: {"bias": torch.zeros(32, dtype=torch.float64)}, "bias"),
    (lambda d: {"packed": torch.zeros(32, 64, dtype=d)}, "packed"),  # right size, not packed
]


@pytest.mark.parametrize("change, message", [
    ({"x": torch.randn(2, 64), "out": torch.empty(2, 32)}, "bfloat16"),
    ({"out": torch.empty(2, 32, dtype=torch.float16)}, "dtypes"),
    ({"packed": torch.zeros(2, 31, 16, 2, dtype=BF16)}, "W"),
    ({"packed": torch.zeros(2, 32, 16, 2)}, "W"),
    ({"packed": torch.zeros(2, 16, 32, 2, dtype=BF16).transpose(1, 2)}, "W"),
    ({"bias": torch.zeros(32, dtype=BF16)}, "bias"),
    ({"packed": torch.zeros(2, 16, 32, 2, dtype=BF16)}, "packed"),
    *[(change(BF16), message) for change, message in COMMON_BAD],
])
def test_bf16_linear_refuses_bad_input(change: dict[str, object], message: str) -> None:
    if not native.bf16_supported():
        pytest.skip("bf16_linear does not run here")
    with pytest.raises(RuntimeError, match=message):
        OPS.bf16_linear(**_args(BF16, **change))


@pytest.mark.parametrize("change, message", [
    ({"x": torch.randn(2, 64).to(BF16), "out": torch.empty(2, 32, dtype=BF16)}, "float32"),
    ({"out": torch.empty(2, 32, dtype=BF16)}, "dtypes"),
    ({"packed": torch.zeros(2, 63, 16)}, "W"),
    ({"packed": torch.zeros(2, 64, 16, dtype=BF16)}, "W"),
    ({"packed": torch.zeros(2, 16, 64).transpose(1, 2)}, "W"),
    ({"packed": torch.zeros(2, 16, 64)}, "packed"),  # right size, [N/16, 16, K]
    *[(change(F32), message) for change, message in COMMON_BAD],
])
def test_f32_linear_refuses_bad_input(change: dict[str, object], message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        OPS.f32_linear(**_args(F32, **change))


@pytest.mark.parametrize("kind", KINDS)
def test_float_linear_refuses_aliased_output(kind: type) -> None:
    """Its tiles read x while others write out: ``out`` overlapping ``x`` would be a wrong
    answer, so it is refused (the integer GEMMs read a quantised copy and allow it)."""
    gen = torch.Generator().manual_seed(2)
    lin = kind(torch.randn(64, 64, generator=gen).to(kind.dtype), None)
    y = torch.randn(3, 64, generator=gen).to(kind.dtype)
    before = y.clone()
    with pytest.raises(RuntimeError, match="single memory location"):
        lin.add_to_(y, y)
    assert torch.equal(y, before), "refused before writing anything"
    # Nor may ``out`` overlap the packed weights or the bias the tiles read.
    name = kind.kernel
    x = torch.randn(1, 64, generator=gen).to(kind.dtype)
    flat = lin.packed.view(-1)
    with pytest.raises(RuntimeError, match="single memory location"):
        getattr(OPS, name)(x, lin.packed, None, flat[:64].view(1, 64), False)
    bias = torch.zeros(64)
    if kind.dtype == torch.float32:  # NOTE: a float32 out can be the float32 bias itself
        with pytest.raises(RuntimeError, match="single memory location"):
            getattr(OPS, name)(x, lin.packed, bias, bias.view(1, 64), False)
