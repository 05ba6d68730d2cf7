"""Shared by the tests of kvloop's integer GEMMs (``q4_linear``, ``q8_linear``): importing
this module skips the importing test module where neither build of them runs (the full
AVX-512 one, or the AVX2 one: ``native.gemm_kernels``); ``GEMMS``, the module holding them,
``BF16`` and ``q8_args``, the arguments of a ``q8_linear`` call that runs.

A plain module (not conftest) so that the tests can import it by name."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvloop.executor.torch import native  # noqa: E402

GEMMS = native.gemm_kernels()
if GEMMS is None:
    pytest.skip("kvloop's integer GEMMs do not run here (neither AVX-512 VNNI nor AVX2, or "
                "no build: see the kvloop.executor.torch.native log)", allow_module_level=True)
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
