"""What a step costs, learned from the steps the scheduler has seen.

``StepTimes`` fits ``step time = overhead + per_token * tokens`` by exponentially weighted
least squares over (tokens scheduled, seconds from schedule to results) of recent steps.
The clock is whatever the scheduler runs on: wall time in the engine, the cost model's
virtual time in the simulator, so the ``slo`` policy predicts with what it observes in both.
"""

from __future__ import annotations

import math


class StepTimes:
    """Online linear model of step time in the number of tokens a step computes."""

    MIN_STEPS = 4
    """Steps seen before predictions are trusted (before that: ``ready`` is False)."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        """Weight of the past per new step (0.98: about the last 50 steps count)."""
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.num_steps = 0
        self.overhead_s = 0.0
        """Fitted seconds per step whatever its size."""
        self.per_token_s = 0.0
        """Fitted seconds per token computed."""

    @property
    def ready(self) -> bool:
        return self.num_steps >= self.MIN_STEPS

    def observe(self, tokens: int, seconds: float) -> None:
        """Add one step that computed ``tokens`` in ``seconds``."""
        if tokens <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        d = self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + tokens
        self._y = self._y * d + seconds
        self._xx = self._xx * d + tokens * tokens
        self._xy = self._xy * d + tokens * seconds
        self.num_steps += 1
        w, x, y = self._w, self._x, self._y
        var = self._xx * w - x * x
        slope = (self._xy * w - x * y) / var if var > 1e-9 * self._xx * w else 0.0
        if slope <= 0.0:
            # NOTE: steps all of one size (or noise) say nothing about the slope: charge
            # the whole mean time per token, which never under-predicts a longer step.
            self.overhead_s, self.per_token_s = 0.0, y / x
            return
        intercept = (y - slope * x) / w
        if intercept < 0.0:
            intercept, slope = 0.0, self._xy / self._xx
        self.overhead_s, self.per_token_s = intercept, slope

    def predict(self, tokens: int) -> float:
        """Seconds for one step of ``tokens`` tokens."""
        return self.overhead_s + self.per_token_s * tokens

    def prefill(self, num_tokens: int, budget: int) -> float:
        """Seconds to prefill ``num_tokens`` in chunks of at most ``budget`` per step."""
        steps = -(-num_tokens // budget) if budget > 0 else 1
        return self.overhead_s * steps + self.per_token_s * num_tokens

    def tokens_within(self, seconds: float) -> int:
        """Most tokens one step can take and still end within ``seconds`` (may be <= 0)."""
        if self.per_token_s <= 0.0:
            return 1 << 30
        return int((seconds - self.overhead_s) / self.per_token_s)
