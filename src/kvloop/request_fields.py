"""The checks of a request's own fields (priority, cache salt, tenant, SLO targets) and the
KV blocks a request needs: one definition, used by the engine's gate
(``engine.intake.validate_request``, which also checks the prompt and the sampling
parameters; ``core.Request`` takes what passed it and checks nothing again) and by the
scheduler's never-fits test.

Each check raises ``InvalidRequestError`` (a ``ValueError``) naming the field. Stdlib only:
every layer may use it.
"""

from __future__ import annotations

import math

from kvloop.errors import InvalidRequestError
from kvloop.sampling_params import is_int64, shown

MAX_TENANT_CHARS = 256
"""Longest tenant name (the OpenAI ``user`` field) accepted."""
MAX_SLO_S = 1e9
"""SLO targets (seconds) must be below this."""


def check_priority(priority: object) -> int:
    """``priority`` unless it is not a 64-bit integer (a bool is not one)."""
    if not is_int64(priority):
        raise InvalidRequestError("priority", "priority must be an integer in [-2^63, 2^63 - 1], "
                                  f"got {shown(priority)}")
    return priority  # type: ignore[return-value]


def check_cache_salt(salt: object) -> str | None:
    """``salt`` unless it is neither None nor a non-empty string."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidRequestError("cache_salt", "cache_salt must be a non-empty string, "
                                  f"got {shown(salt)}")
    return salt


def check_tenant(tenant: object, field: str = "tenant") -> str:
    """The tenant name to queue (``""`` for None: none), unless not a string of at most
    :data:`MAX_TENANT_CHARS` characters."""
    if tenant is None:
        return ""
    if not isinstance(tenant, str):
        raise InvalidRequestError(field, f"{field} must be a string, got "
                                  f"{type(tenant).__name__}")
    if len(tenant) > MAX_TENANT_CHARS:
        raise InvalidRequestError(field, f"{field} is {len(tenant)} characters; at most "
                                  f"{MAX_TENANT_CHARS} are allowed")
    return tenant


def check_slo(field: str, value: object) -> float | None:
    """An SLO target in seconds, as a float (None stays None: the scheduler's default),
    unless not positive, finite and below :data:`MAX_SLO_S`."""
    if value is None:
        return None
    if (not isinstance(value, int | float) or isinstance(value, bool)
            or not math.isfinite(value) or not 0 < value < MAX_SLO_S):
        raise InvalidRequestError(field, f"{field} must be a positive, finite number of "
                                  f"seconds (below {MAX_SLO_S:g}), got {shown(value)}")
    return float(value)


def kv_blocks_needed(num_prompt_tokens: int, max_tokens: int, n: int, block_size: int) -> int:
    """KV blocks a request needs at its longest: ``n`` sequences of prompt + ``max_tokens``
    tokens, sharing the prompt's full blocks (all but the block its last token is in,
    which each sequence writes its own copy of)."""
    per_sequence = -(-(num_prompt_tokens + max_tokens) // block_size)
    if n <= 1:
        return per_sequence
    shared = (num_prompt_tokens - 1) // block_size
    return shared + n * (per_sequence - shared)
