"""Sampling parameters of one request, validated on construction (stdlib only)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvloop.errors import InvalidRequestError

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
"""The range of integer request fields that have no narrower one (``seed``, ``priority``,
``stop_token_ids``): what a 64-bit integer holds, as OpenAI's and vLLM's ``seed``."""
GREEDY_TEMPERATURE = 1e-5
"""A temperature below this samples greedily, as vLLM's (its ``_SAMPLING_EPS``): dividing
float32 logits by a tinier one overflows them to infinities, whose softmax is NaN."""
MIN_REPETITION_PENALTY = 1e-6
"""The smallest ``repetition_penalty``: vLLM takes any positive one, but tinier penalties
divide float32 logits into infinities (and so NaN probabilities)."""
MAX_STOP_STRINGS = 64
"""Most ``stop`` strings per request (every output token is checked against each)."""
MAX_STOP_TOKEN_IDS = 1024
"""Most ``stop_token_ids`` per request (each is masked while ``min_tokens`` is unmet)."""


@dataclass
class SamplingParams:
    """How to sample a request's output and when to stop it.

    Invalid values raise ``InvalidRequestError`` (a ``ValueError``) with the field as data.
    """

    max_tokens: int = 16
    """Most output tokens to generate."""
    temperature: float = 1.0
    """Softmax temperature; 0 (or anything below ``GREEDY_TEMPERATURE``) means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens (0 or -1: all)."""
    min_p: float = 0.0
    """Drop tokens below ``min_p`` × the top token's probability, in [0, 1]."""
    seed: int | None = None
    """Per-request seed for reproducible sampling (a 64-bit integer)."""
    presence_penalty: float = 0.0
    """Penalty for tokens already present in the output, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Penalty proportional to a token's count in the output, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """Multiplicative penalty (at least 1e-6) on tokens seen in prompt or output; 1
    disables it."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (at most ``MAX_STOP_STRINGS``); the matched string is not returned."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end the request (the token is kept in the output ids); at most
    ``MAX_STOP_TOKEN_IDS``."""
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
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
               "must be an integer >= 1", self.max_tokens)
        _check(_is_int(self.n) and self.n >= 1, "n", "must be an integer >= 1", self.n)
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens", "must be an integer in [0, max_tokens]", self.min_tokens)
        _check(self.temperature >= 0.0, "temperature", "must be >= 0", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]", self.top_p)
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k",
               "must be -1, 0 or a positive integer", self.top_k)
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]", self.min_p)
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]",
               self.presence_penalty)
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               "must be in [-2, 2]", self.frequency_penalty)
        _check(self.repetition_penalty >= MIN_REPETITION_PENALTY, "repetition_penalty",
               f"must be >= {MIN_REPETITION_PENALTY:g}", self.repetition_penalty)
        _check(self.seed is None or is_int64(self.seed), "seed",
               "must be None or an integer in [-2^63, 2^63 - 1]", self.seed)
        _check(self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
               "logprobs", "must be None or an integer >= 0", self.logprobs)
        _check(isinstance(self.stop, list | tuple) and len(self.stop) <= MAX_STOP_STRINGS
               and all(isinstance(s, str) and s for s in self.stop), "stop",
               f"must be at most {MAX_STOP_STRINGS} non-empty strings", self.stop)
        _check(isinstance(self.stop_token_ids, list | tuple)
               and len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
               and all(is_int64(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", f"must be at most {MAX_STOP_TOKEN_IDS} non-negative integers "
               "below 2^63", self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_int64(value: object) -> bool:
    """Whether ``value`` is an integer (not a bool) in ``[INT64_MIN, INT64_MAX]``."""
    return _is_int(value) and INT64_MIN <= value <= INT64_MAX  # type: ignore[operator]


def shown(value: object, limit: int = 80) -> str:
    """``repr(value)`` for an error message, cut to about ``limit`` characters (a client's
    value may be a 4,000-digit integer or a megabyte of text)."""
    if _is_int(value) and value.bit_length() > 64:  # type: ignore[attr-defined]
        return f"an integer of {value.bit_length()} bits"  # type: ignore[attr-defined]
    if isinstance(value, list | tuple | dict) and len(value) > 8:
        return f"a list of {len(value)} items"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise InvalidRequestError(name, f"{name} {rule}, got {shown(value)}")
