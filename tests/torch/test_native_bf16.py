"""kvloop's bfloat16 GEMM (``native.bf16_linear``, ``linear.Bf16Linear``): exact where the
float32 sums are exact (integer-valued operands), torch's product up to the order of its
float32 sums elsewhere, the residual add rounded once, ``make_linear`` choosing it only where
it runs, a NaN activation poisoning its row only, and bad input refused with a RuntimeError
(a ValueError naming the matrix from ``Bf16Linear``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from native_helpers import BF16, KERNELS  # noqa: E402

from kvloop.executor.torch import native  # noqa: E402
from kvloop.executor.torch.linear import (  # noqa: E402
    Bf16Linear,
    bf16_runs,
    make_linear,
)

if not native.bf16_supported():
    pytest.skip("bf16_linear does not run here (the full build without AVX-512 BF16)",
                allow_module_level=True)

SHAPES = [(16, 32), (48, 96), (64, 256), (160, 64)]


def integers(*shape: int, gen: torch.Generator, span: int = 8) -> torch.Tensor:
    """Integers in [-span, span) as bfloat16 (exact): their products and sums stay exact in
    float32, so a right kernel matches the float64 reference to the bit."""
    return torch.randint(-span, span, shape, generator=gen).to(BF16)


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 17])
def test_bf16_linear_is_exact_on_integers(m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x = integers(n, k, gen=gen), integers(m, k, gen=gen)
    bias = integers(n, gen=gen)
    lin = Bf16Linear(w, bias)
    ref = x.double() @ w.double().t() + bias.double()
    # Able to fail: any misplaced weight or input pair changes an integer sum.
    assert torch.equal(lin(x), ref.to(BF16))
    out = integers(m, n, gen=gen, span=64)
    want = (out.double() + ref).to(BF16)
    lin.add_to_(out, x)
    assert torch.equal(out, want), "the residual add is rounded once, with the product"


@pytest.mark.parametrize("m", [1, 4, 6, 33])
def test_bf16_linear_is_torchs_product(m: int) -> None:
    """Random values: within a bfloat16 step or two of torch's own product (which sums in
    another order), and close to the float64 reference."""
    gen = torch.Generator().manual_seed(m)
    w = (torch.randn(96, 128, generator=gen) * 0.05).to(BF16)
    x = torch.randn(m, 128, generator=gen).to(BF16)
    bias = torch.randn(96, generator=gen).to(BF16)
    y = Bf16Linear(w, bias)(x)
    ref = x.double() @ w.double().t() + bias.double()
    torch.testing.assert_close(y.double(), ref, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, bias), atol=2e-2, rtol=1e-2)
    # A strided input (the gate half of a fused gate/up output) is accepted (made contiguous).
    wide = torch.randn(m, 256, generator=gen).to(BF16)
    assert torch.equal(Bf16Linear(w, None)(wide[:, :128]),
                       Bf16Linear(w, None)(wide[:, :128].contiguous()))


def test_pack_bf16_layout() -> None:
    """``[N/16, K/2, 16, 2]``: the pair of inputs (2p, 2p + 1) of output 16 t + i at
    ``[t, p, i]``."""
    w = torch.arange(32 * 64, dtype=torch.float32).view(32, 64).to(BF16)
    p = native.pack_bf16(w)
    assert p.shape == (2, 32, 16, 2) and p.is_contiguous()
    assert torch.equal(p[1, 5, 3], w[16 + 3, 10:12])


def test_make_linear_picks_bf16_where_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(1)
    for n, k, runs in [(48, 64, True), (24, 64, False), (48, 48, False)]:
        w = torch.randn(n, k, generator=gen).to(BF16)
        assert bf16_runs(w) is runs
        assert isinstance(make_linear(w, None), Bf16Linear) is runs, (n, k)
    w = torch.randn(48, 64, generator=gen)
    assert not bf16_runs(w) and not isinstance(make_linear(w, None), Bf16Linear), "float32"
    assert not bf16_runs(w.half())
    with pytest.raises(ValueError, match="Bf16Linear needs"):
        Bf16Linear(w, None)
    if KERNELS.__name__ == native.FULL.name:
        with monkeypatch.context() as patch:  # a CPU with VNNI but without AVX-512 BF16
            patch.setattr(native, "cpu_flags", lambda: frozenset({"avx512_vnni"}))
            assert not native.bf16_supported()
            assert not isinstance(make_linear(w.to(BF16), None), Bf16Linear)
    with monkeypatch.context() as patch:  # NOTE: native.kernels is cached: patch the name
        patch.setattr(native, "kernels", lambda: None)
        assert not bf16_runs(w.to(BF16))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_bf16_linear_propagates_non_finite_activations(bad: float) -> None:
    gen = torch.Generator().manual_seed(5)
    lin = Bf16Linear(torch.randn(32, 96, generator=gen).to(BF16), None)
    x = torch.randn(3, 96, generator=gen).to(BF16)
    x[1, 40] = bad
    y = lin(x)
    assert not y[1].isfinite().any()
    assert y[0].isfinite().all() and y[2].isfinite().all()


def _args(m: int = 2, n: int = 32, k: int = 64, **change: object) -> dict[str, object]:
    args: dict[str, object] = {
        "x": torch.randn(m, k).to(BF16),
        "packed": torch.zeros(n // 16, k // 2, 16, 2, dtype=BF16),
        "bias": None,
        "out": torch.empty(m, n, dtype=BF16),
        "accumulate": False,
    }
    args.update(change)
    return args


@pytest.mark.parametrize("change, message", [
    ({"x": torch.randn(2, 64), "out": torch.empty(2, 32)}, "bfloat16"),
    ({"out": torch.empty(2, 32)}, "dtypes"),
    ({"packed": torch.zeros(2, 31, 16, 2, dtype=BF16)}, "W"),
    ({"packed": torch.zeros(2, 32, 16, 2)}, "W"),
    ({"packed": torch.zeros(2, 16, 32, 2, dtype=BF16).transpose(1, 2)}, "W"),
    ({"x": torch.randn(2, 48).to(BF16)}, "shapes"),
    ({"out": torch.empty(3, 32, dtype=BF16)}, "shapes"),
    ({"out": torch.empty(2, 24, dtype=BF16)}, "shapes"),
    ({"x": torch.randn(64, 2).to(BF16).t()}, "layout"),
    ({"bias": torch.zeros(31)}, "bias"),
    ({"bias": torch.zeros(32, dtype=BF16)}, "bias"),
    ({"packed": torch.zeros(32, 64, dtype=BF16)}, "packed"),  # right size, not packed
    ({"packed": torch.zeros(2, 16, 32, 2, dtype=BF16)}, "packed"),
])
def test_bf16_linear_refuses_bad_input(change: dict[str, object], message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        KERNELS.bf16_linear(**_args(**change))


def test_bf16_linear_refuses_aliased_output() -> None:
    """Its tiles read x while others write out: ``out`` overlapping ``x`` would be a wrong
    answer, so it is refused (the integer GEMMs read a quantised copy and allow it)."""
    gen = torch.Generator().manual_seed(2)
    lin = Bf16Linear(torch.randn(64, 64, generator=gen).to(BF16), None)
    y = torch.randn(3, 64, generator=gen).to(BF16)
    before = y.clone()
    with pytest.raises(RuntimeError, match="single memory location"):
        lin.add_to_(y, y)
    assert torch.equal(y, before), "refused before writing anything"
