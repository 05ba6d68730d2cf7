"""Shared by the tests of kvloop's own CPU kernels (``executor.torch.native``) in
``test_native_gemm``, ``test_native_attention`` and ``test_native_layer_ops``: importing this
module skips the importing test module where the kernels do not run; ``KERNELS`` (the built
kernels: the full build, or the AVX2 one on CPUs without AVX-512 VNNI), ``OPS``, ``BF16``,
``q8_args``, the arguments of a ``q8_linear`` call that runs, and
``LogitRecorder``, to compare two runs' logits step by step.

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
OPS = torch.ops.kvloop
"""The kernels that are torch operators (``native.OPS``), loaded with ``KERNELS``."""
BF16 = torch.bfloat16


def q8_args(m: int = 2, n: int = 32, k: int = 64, **change: object) -> dict[str, object]:
    args: dict[str, object] = {
        "x": torch.randn(m, k).to(BF16),
        "packed": torch.zeros(n // 16, k // 32, 512, dtype=torch.int8),
        "scales": torch.ones(n // 16, k // 32, 16, dtype=torch.float16),
        "bias": None,
        "out": torch.empty(m, n, dtype=BF16),
        "accumulate": False,
    }
    args.update(change)
    return args


Key = tuple[tuple[int, ...], int]
"""A sampled row: (its request's prompt, how many tokens it had output before)."""


class LogitRecorder:
    """Records the float32 logits of every row a runner's sampler sees, by :data:`Key`, and
    replaces the sampled token by ``forced[key]`` where given: a second run fed the first
    run's tokens (:meth:`force`) then follows it even where the two see a near-tie."""

    def __init__(self, runner: object, monkeypatch: pytest.MonkeyPatch) -> None:
        self.logits: dict[Key, torch.Tensor] = {}
        self.forced: dict[Key, int] = {}
        real = runner.sampler.sample  # type: ignore[attr-defined]

        def recording(rows, states):  # type: ignore[no-untyped-def]
            tokens, lps = real(rows, states)
            for i, s in enumerate(states):
                key = (tuple(s.prompt_token_ids), len(s.output_token_ids))
                self.logits[key] = rows[i].float().clone()
                tokens[i] = self.forced.get(key, tokens[i])
            return tokens, lps

        monkeypatch.setattr(runner.sampler, "sample", recording)  # type: ignore[attr-defined]

    def force(self, requests: list) -> dict[Key, torch.Tensor]:
        """Force the next run to ``requests``' output tokens; return (and forget) the
        logits recorded so far."""
        self.forced.update({(tuple(r.prompt_token_ids), i): t for r in requests
                            for i, t in enumerate(r.output_token_ids)})
        recorded, self.logits = self.logits, {}
        return recorded
