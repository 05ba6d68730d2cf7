"""One definition of a request's own field checks (``kvloop.request_fields``): the engine's
gate and a request built directly refuse the same values, naming the same field."""

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
def test_the_gate_and_the_core_refuse_the_same(field: str, kwargs: dict) -> None:
    with pytest.raises(InvalidRequestError) as gate:
        validate_request([1, 2, 3], None, LIMITS, **kwargs)
    with pytest.raises(InvalidRequestError) as core:
        Request("r", [1, 2, 3], **kwargs)
    assert gate.value.field == core.value.field == field
    assert str(gate.value) == str(core.value)


@pytest.mark.parametrize(("prompt", "max_tokens", "n", "expected"), [
    (1, 15, 1, 1), (16, 16, 1, 2), (17, 1, 1, 2),
    (33, 10, 3, 2 + 3 * 1),  # two full prompt blocks shared, each sequence its own third
    (32, 1, 2, 1 + 2 * 2),  # the block holding the last prompt token is not shared
])
def test_kv_blocks_needed(prompt: int, max_tokens: int, n: int, expected: int) -> None:
    assert kv_blocks_needed(prompt, max_tokens, n, 16) == expected
