"""kvloop's kernels as torch operators (``native.OPS``): each one's schema says what it
writes, its fake implementation lets ``torch.compile`` trace it, and torch's profiler names
it. ``torch.library.opcheck`` runs each on real arguments and checks all three."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from native_helpers import OPS, q8_args  # noqa: E402
from test_native_attention import _attention_args  # noqa: E402
from test_native_float_linear import _args as _float_args  # noqa: E402
from test_native_gemm import _q4_args  # noqa: E402
from test_native_layer_ops import _rms_args, _rope_args, _silu_args  # noqa: E402
from test_native_prefill_attention import _args as _prefill_args  # noqa: E402

from kvloop.executor.torch import native  # noqa: E402

ARGS = {
    "q4_linear": _q4_args,
    "q8_linear": q8_args,
    "bf16_linear": lambda: _float_args(torch.bfloat16),
    "f32_linear": lambda: _float_args(torch.float32),
    "decode_attention": _attention_args,
    "prefill_attention": _prefill_args,
    "rms_norm": _rms_args,
    "rope_write_kv": _rope_args,
    "silu_mul": _silu_args,
}


def test_every_operator_has_its_arguments_here() -> None:
    assert set(ARGS) == set(native.OPS)


@pytest.mark.parametrize("name", native.OPS)
def test_operator_passes_opcheck(name: str) -> None:
    if name == "bf16_linear" and not native.bf16_supported():
        pytest.skip("bf16_linear does not run on this CPU")
    torch.library.opcheck(getattr(OPS, name).default, (), ARGS[name]())


def test_a_compiled_function_calls_the_operator() -> None:
    """``torch.compile`` traces through an operator (its fake implementation gives the
    shapes) and the compiled function writes what the eager one does."""

    def norm_twice(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        native.call("rms_norm", x, w, 1e-5, out)
        return out * 2

    args = _rms_args()
    x, w = args["x"], args["weight"]
    compiled = torch.compile(norm_twice, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, w), norm_twice(x, w))


@pytest.mark.parametrize("name", native.OPS)
def test_the_profiler_names_the_operator(name: str) -> None:
    if name == "bf16_linear" and not native.bf16_supported():
        pytest.skip("bf16_linear does not run on this CPU")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        native.call(name, *ARGS[name]().values())
    assert f"kvloop::{name}" in {e.key for e in prof.key_averages()}
