"""Shared by the tests of kvloop's own CPU kernels (``executor.torch.native``) in
``test_native_gemm``, ``test_native_attention`` and ``test_native_layer_ops``: importing this
module skips the importing test module where the kernels do not run; ``KERNELS`` (the built
kernels), ``BF16``, and ``q8_args``, the arguments of a ``q8_linear`` call that runs.

A plain module (not conftest) so that the tests can import it by name."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvloop.executor.torch import native  # noqa: E402

_REASON = native.unavailable_reason()
if _REASON is None and native.kernels() is None:
    _REASON = "they did not build (see the kvloop.executor.torch.native log)"
if _REASON is not None:
    pytest.skip(f"kvloop's CPU kernels do not run here: {_REASON}", allow_module_level=True)

KERNELS = native.kernels()
BF16 = torch.bfloat16


def q8_args(m: int = 2, n: int = 32, k: int = 64, **change: object) -> dict[str, object]:
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
