"""Output-length predictors for the length-aware policies, looked up in ``PREDICTORS``.

A predictor guesses how many tokens a request will generate, once, when the policy first
asks; the guess stays fixed (the waiting queue's keys must not change while a request
waits) and is forgotten when the request finishes, when the predictor may learn from it.

- ``oracle``: the request's ``max_tokens``. In the simulator, whose requests generate
  exactly ``max_tokens`` (``ignore_eos``), that is the true length; in the engine it is
  the client's bound.
- ``noisy``: the oracle with log-normal noise sized for a chosen Kendall's tau between
  predicted and true lengths (``predictor_tau``): for Gaussians, tau = 2/pi * asin(rho),
  so the noise's spread is ``s * sqrt(1/rho^2 - 1)`` with ``s`` the spread of the log
  lengths seen so far. Each request's noise comes from its id, so runs repeat.
- ``history``: what runs in the engine without knowing the future. It keeps the mean log
  output length of finished requests by (tenant, prompt-length octave), by octave alone
  and overall, and predicts from the narrowest of those with ``MIN_SAMPLES`` samples
  (before any: ``PRIOR_TOKENS``).

Every predictor records (predicted, generated) for each completed request in ``pairs``
(up to ``MAX_PAIRS``), so a run can report its Kendall's tau.
"""

from __future__ import annotations

import math
import random
from typing import ClassVar

from kvloop.core.request import Request, RequestStatus

MIN_SAMPLES = 8
"""Finished requests a history cell needs before it predicts."""
PRIOR_TOKENS = 256.0
"""The history predictor's guess before anything finished."""
MAX_PAIRS = 1 << 20
"""Most (predicted, generated) pairs kept for reporting."""


class LengthPredictor:
    """Predicts a request's output tokens; learns from finished ones."""

    name: ClassVar[str] = ""

    def __init__(self, tau: float = 1.0) -> None:
        self.tau = tau
        self._fixed: dict[str, float] = {}
        self.pairs: list[tuple[float, int]] = []
        """(predicted, generated) of each completed request, in finishing order."""

    def predict(self, request: Request) -> float:
        """Predicted output tokens of ``request`` (>= 1), fixed at the first call."""
        rid = request.request_id
        value = self._fixed.get(rid)
        if value is None:
            value = self._fixed[rid] = max(1.0, self.guess(request))
        return value

    def guess(self, request: Request) -> float:
        raise NotImplementedError

    def learn(self, request: Request) -> None:
        """A completed request's true length (predictors that learn override this)."""

    def forget(self, request: Request) -> None:
        """The request finished: record and learn from it if it completed."""
        value = self._fixed.pop(request.request_id, None)
        if request.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            return
        if value is not None and len(self.pairs) < MAX_PAIRS:
            self.pairs.append((value, len(request.output_token_ids)))
        self.learn(request)


class OraclePredictor(LengthPredictor):
    """``max_tokens``: the true length in the simulator."""

    name = "oracle"

    def guess(self, request: Request) -> float:
        return float(request.sampling_params.max_tokens)


class NoisyOraclePredictor(LengthPredictor):
    """The oracle with log-normal noise for a target Kendall's tau (``tau`` in [0, 1])."""

    name = "noisy"

    def __init__(self, tau: float = 0.5) -> None:
        super().__init__(tau)
        rho = math.sin(math.pi * tau / 2)
        self._ratio = math.sqrt(1 / (rho * rho) - 1) if rho > 0 else math.inf
        """Noise spread per unit of log-length spread."""
        self._n = 0
        self._mean = self._m2 = 0.0

    def guess(self, request: Request) -> float:
        x = math.log(request.sampling_params.max_tokens)
        self._n += 1  # NOTE: Welford's running spread of the (oracle's) log lengths
        d = x - self._mean
        self._mean += d / self._n
        self._m2 += d * (x - self._mean)
        spread = math.sqrt(self._m2 / self._n) if self._n >= MIN_SAMPLES else 1.0
        z = random.Random(f"{request.request_id}/{self.tau}").gauss(0.0, 1.0)
        if math.isinf(self._ratio):
            return math.exp(self._mean + spread * z)  # tau 0: unrelated to the truth
        return math.exp(x + spread * self._ratio * z)


class HistoryPredictor(LengthPredictor):
    """Mean log output length of finished requests by tenant and prompt-length octave."""

    name = "history"

    def __init__(self, tau: float = 1.0) -> None:
        super().__init__(tau)
        self._cells: dict[tuple[str, int] | int | None, list[float]] = {}
        """Cell -> [count, sum of log lengths]: (tenant, octave), octave, None (all)."""

    @staticmethod
    def _octave(request: Request) -> int:
        return request.num_prompt_tokens.bit_length()

    def guess(self, request: Request) -> float:
        octave = self._octave(request)
        for cell in ((request.tenant, octave), octave, None):
            c = self._cells.get(cell)
            if c is not None and c[0] >= MIN_SAMPLES:
                return math.exp(c[1] / c[0])
        return PRIOR_TOKENS

    def learn(self, request: Request) -> None:
        x = math.log(max(1, len(request.output_token_ids)))
        octave = self._octave(request)
        for cell in ((request.tenant, octave), octave, None):
            c = self._cells.setdefault(cell, [0.0, 0.0])
            c[0] += 1
            c[1] += x


PREDICTORS: dict[str, type[LengthPredictor]] = {
    p.name: p for p in (OraclePredictor, NoisyOraclePredictor, HistoryPredictor)
}


def make_predictor(name: str, tau: float) -> LengthPredictor:
    """The predictor ``name`` (``noisy`` aims at Kendall's tau ``tau``)."""
    try:
        cls = PREDICTORS[name]
    except KeyError:
        raise ValueError(f"length_predictor must be one of {', '.join(PREDICTORS)}; "
                         f"got {name!r}") from None
    return cls(tau)
