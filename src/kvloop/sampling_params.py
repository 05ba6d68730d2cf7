"""Sampling parameters of one request, validated on construction (stdlib only)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvloop.errors import InvalidRequestError


@dataclass
class SamplingParams:
    """How to sample a request's output and when to stop it.

    Invalid values raise ``InvalidRequestError`` (a ``ValueError``) with the field as data.
    """

    max_tokens: int = 16
    """Most output tokens to generate."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens (0 or -1: all)."""
    min_p: float = 0.0
    """Drop tokens below ``min_p`` × the top token's probability, in [0, 1]."""
    seed: int | None = None
    """Per-request seed for reproducible sampling."""
    presence_penalty: float = 0.0
    """Penalty for tokens already present in the output, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Penalty proportional to a token's count in the output, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """Multiplicative penalty (> 0) on tokens seen in prompt or output; 1 disables it."""
    stop: list[str] = field(default_factory=list)
    """Stop strings; the matched string is not returned."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end the request (the token is kept in the output ids)."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS token."""
    logprobs: int | None = None
    """Return this many top log-probabilities per output token (None: none)."""
    n: int = 1
    """Output sequences to sample from the prompt (they share its KV blocks)."""
    min_tokens: int = 0
    """Output tokens before EOS or a ``stop_token_ids`` token may end the request (they are
    masked from sampling until then), in [0, max_tokens]."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise ``InvalidRequestError`` naming the first invalid field (also after mutation)."""
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            # NOTE: NaN and ±Infinity are refused alike (JSON bodies can carry both).
            _check(isinstance(value, int | float) and not isinstance(value, bool)
                   and math.isfinite(value), name, "must be a finite number", value)
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            "max_tokens",
            "must be an integer >= 1",
            self.max_tokens,
        )
        _check(isinstance(self.n, int) and not isinstance(self.n, bool) and self.n >= 1,
               "n", "must be an integer >= 1", self.n)
        _check(isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool)
               and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens", "must be an integer in [0, max_tokens]", self.min_tokens)
        _check(self.temperature >= 0.0, "temperature", "must be >= 0", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]", self.top_p)
        _check(
            isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1),
            "top_k",
            "must be -1, 0 or a positive integer",
            self.top_k,
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]", self.min_p)
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            "must be in [-2, 2]",
            self.presence_penalty,
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            "must be in [-2, 2]",
            self.frequency_penalty,
        )
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            "must be > 0",
            self.repetition_penalty,
        )
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
            "logprobs",
            "must be None or an integer >= 0",
            self.logprobs,
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must be non-empty strings",
            self.stop,
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative integers",
            self.stop_token_ids,
        )

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise InvalidRequestError(name, f"{name} {rule}, got {value!r}")
