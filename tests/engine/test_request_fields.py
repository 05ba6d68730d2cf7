"""A request's own field checks (``kvloop.request_fields``): the engine's gate refuses each
bad value naming its field; the core does not check again."""

from __future__ import annotations

import pytest

from kvloop.core.request import Request
from kvloop.engine.intake import EngineLimits, validate_request
from kvloop.errors import InvalidRequestError
from kvloop.request_fields import MAX_TENANT_CHARS, kv_blocks_needed

LIMITS = EngineLimits(max_model_len=4096, kv_cache_tokens=1 << 16, block_size=16)

BAD = [
    ("priority", {"priority": True}),
    ("priority", {"priority": 2**63}),
    ("priority", {"priority": 1.5}),
    ("tenant", {"tenant": "t" * (MAX_TENANT_CHARS + 1)}),
    ("tenant", {"tenant": 7}),
    ("cache_salt", {"cache_salt": ""}),
    ("slo_ttft", {"slo_ttft": float("nan")}),
    ("slo_tpot", {"slo_tpot": -1.0}),
    ("slo_ttft", {"slo_ttft": True}),
]


@pytest.mark.parametrize(("field", "kwargs"), BAD)
def test_the_gate_refuses_naming_the_field(field: str, kwargs: dict) -> None:
    with pytest.raises(InvalidRequestError) as gate:
        validate_request([1, 2, 3], None, LIMITS, **kwargs)
    assert gate.value.field == field and field in str(gate.value)


def test_the_core_does_not_check_again() -> None:
    """The core takes what the gate passed (a check there would be a second copy)."""
    assert Request("r", [1, 2, 3], tenant="t" * (MAX_TENANT_CHARS + 1)).tenant


@pytest.mark.parametrize(("prompt", "max_tokens", "n", "expected"), [
    (1, 15, 1, 1), (16, 16, 1, 2), (17, 1, 1, 2),
    (33, 10, 3, 2 + 3 * 1),  # two full prompt blocks shared, each sequence its own third
    (32, 1, 2, 1 + 2 * 2),  # the block holding the last prompt token is not shared
])
def test_kv_blocks_needed(prompt: int, max_tokens: int, n: int, expected: int) -> None:
    assert kv_blocks_needed(prompt, max_tokens, n, 16) == expected
