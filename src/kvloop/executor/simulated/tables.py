"""Measured per-step costs by token and request count (``kvloop profile``'s tables).

Pure stdlib, imported by the cost model.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass


def _slope(xs: tuple[int, ...], ys: tuple[float, ...]) -> float:
    """Least-squares slope of the upper half of the points (at least three when there
    are), never below 0: one noisy last point must not bend what lies beyond the table."""
    n = min(len(xs), max(3, (len(xs) + 1) // 2))
    px, py = xs[-n:], ys[-n:]
    mx, my = sum(px) / n, sum(py) / n
    var = sum((x - mx) ** 2 for x in px)
    return max(0.0, sum((x - mx) * (y - my) for x, y in zip(px, py, strict=True)) / var)


def _interp(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise-linear through (xs, ys); beyond the last point the upper half's
    least-squares slope from the last point; below the first, the first segment's slope
    (never below 0)."""
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return ys[i]
    if i >= len(xs):
        return ys[-1] + _slope(xs, ys) * (x - xs[-1])
    i = max(i, 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class StepTables:
    """Measured per-step costs that depend only on the number of tokens or requests."""

    tokens: tuple[int, ...]
    """Token counts measured, ascending."""
    token_time_s: tuple[float, ...]
    """Seconds of everything a step does per token except attention and the LM head:
    embedding, every layer's GEMMs, norms, RoPE, activation and residual adds."""
    seqs: tuple[int, ...]
    """Request counts measured, ascending."""
    seq_time_s: tuple[float, ...]
    """Seconds of the final norm, LM head and sampler for that many requests."""

    def __post_init__(self) -> None:
        for xs, ys, name in ((self.tokens, self.token_time_s, "tokens"),
                             (self.seqs, self.seq_time_s, "seqs")):
            if len(xs) < 2 or len(xs) != len(ys):
                raise ValueError(f"tables.{name}: need >= 2 points and one time per point")
            if list(xs) != sorted(set(xs)) or xs[0] < 1:
                raise ValueError(f"tables.{name}: counts must be >= 1 and ascending")
            if not all(isinstance(y, (int, float)) and math.isfinite(y) and y >= 0 for y in ys):
                raise ValueError(f"tables.{name}: times must be finite and >= 0")

    def token_time(self, t: int) -> float:
        return _interp(self.tokens, self.token_time_s, t)

    def seq_time(self, s: int) -> float:
        return _interp(self.seqs, self.seq_time_s, s)
