"""Validate once: every rejection names its field as data, a rejected request leaves the engine
untouched, and the engine queues a validated request as it is."""

from __future__ import annotations

import dataclasses

import pytest

from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core import Scheduler
from kvloop.engine.intake import (
    EngineLimits,
    ValidatedRequest,
    default_max_tokens,
    encode_prompt,
    validate_request,
)
from kvloop.engine.llm_engine import LLMEngine
from kvloop.errors import InvalidRequestError
from kvloop.executor.simulated import (
    CostModel,
    SimulatedExecutor,
    get_hardware_spec,
    get_model_spec,
)
from kvloop.sampling_params import SamplingParams

LIMITS = EngineLimits(max_model_len=256, kv_cache_tokens=200, vocab_size=1000)


class _WordTokenizer:
    """One token per word: its length (enough to tell text from ids)."""

    def encode(self, prompt: str) -> list[int]:
        return [len(w) for w in prompt.split()]


def _engine(tokenizer: object | None = None) -> LLMEngine:
    s = Scheduler(
        SchedulerConfig(max_model_len=256),
        CacheConfig(block_size=4, num_gpu_blocks=50),
    )
    cost = CostModel(get_model_spec("smollm2-135m"), get_hardware_spec("l4"))
    return LLMEngine(s, SimulatedExecutor(cost, 4), tokenizer=tokenizer, vocab_size=1000)


def _params(**kw: object) -> SamplingParams:
    p = SamplingParams()
    for k, v in kw.items():
        setattr(p, k, v)  # NOTE: bypasses construction, as a caller mutating params would
    return p


REJECTED = [
    ("prompt", [], None, {}),
    ("prompt", "", None, {}),
    ("prompt", "text without a tokenizer", None, {}),
    ("prompt", [1, 2.5], None, {}),
    ("prompt", [1, True], None, {}),
    ("prompt", [1000], None, {}),
    ("prompt", [-1], None, {}),
    ("prompt", 5, None, {}),
    ("prompt", b"bytes", None, {}),
    ("prompt", {"prompt": "a", "prompt_token_ids": [1]}, None, {}),
    ("prompt", {}, None, {}),
    ("prompt", {"prompt": [1, 2]}, None, {}),
    ("prompt", {"prompt_token_ids": "1 2"}, None, {}),
    ("prompt", {"prompt_token_ids": [1], "multi_modal_data": {}}, None, {}),
    ("prompt", list(range(1, 201)), None, {}),  # the KV pool holds 200 tokens
    ("max_tokens", list(range(1, 100)), SamplingParams(max_tokens=102), {}),
    ("max_tokens", [1], _params(max_tokens=0), {}),
    ("temperature", [1], _params(temperature=-1.0), {}),
    ("top_p", [1], _params(top_p=0.0), {}),
    ("top_k", [1], _params(top_k=-5), {}),
    ("stop_token_ids", [1], _params(stop_token_ids=[-3]), {}),
    ("stop", [1], SamplingParams(stop=["x"]), {}),  # no tokenizer to match text with
    ("sampling_params", [1], {"max_tokens": 3}, {}),
    ("priority", [1], None, {"priority": "high"}),
    ("priority", [1], None, {"priority": True}),
    ("cache_salt", [1], None, {"cache_salt": ""}),
    ("cache_salt", {"prompt_token_ids": [1], "cache_salt": 7}, None, {}),
]


@pytest.mark.parametrize(("field", "prompt", "params", "kw"), REJECTED,
                         ids=[f"{f}-{i}" for i, (f, *_) in enumerate(REJECTED)])
def test_every_rejection_names_its_field(field, prompt, params, kw):
    with pytest.raises(InvalidRequestError) as info:
        validate_request(prompt, params, LIMITS, **kw)
    assert info.value.field == field
    assert isinstance(info.value, ValueError) and str(info.value) == info.value.message
    e = _engine()
    with pytest.raises(InvalidRequestError) as again:
        e.add_request("bad", prompt, params, **kw)
    assert again.value.field == field
    assert not e.has_unfinished_requests()  # nothing leaked: no request, no block
    assert e.stats().num_waiting == 0 and e.stats().kv_usage == 0.0
    e.scheduler.check_invariants()


def test_sampling_params_errors_carry_the_field():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(presence_penalty=3.0)
    assert info.value.field == "presence_penalty"
    assert info.value.message.startswith("presence_penalty must be in [-2, 2]")


def test_prompt_forms_encode_alike():
    tok = _WordTokenizer()
    as_text = validate_request("one three", None, LIMITS, tokenizer=tok)
    as_dict = validate_request({"prompt": "one three"}, None, LIMITS, tokenizer=tok)
    as_ids = validate_request([3, 5], None, LIMITS, tokenizer=tok)
    as_ids_dict = validate_request({"prompt_token_ids": (3, 5)}, None, LIMITS)
    assert {r.prompt_token_ids for r in (as_text, as_dict, as_ids, as_ids_dict)} == {(3, 5)}
    assert as_text.prompt == as_dict.prompt == "one three"
    assert as_ids.prompt is None and as_ids_dict.prompt is None
    salted = validate_request({"prompt_token_ids": [3], "cache_salt": "t1"}, None, LIMITS)
    assert salted.cache_salt == "t1"
    assert validate_request([3], None, LIMITS, cache_salt="t2").cache_salt == "t2"


def test_validated_request_is_frozen_and_owns_its_params():
    params = SamplingParams(max_tokens=4, stop_token_ids=[9])
    req = validate_request([1, 2], params, LIMITS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.priority = 3  # type: ignore[misc]
    params.max_tokens = 10_000
    params.stop_token_ids.append(-1)
    assert req.params.max_tokens == 4 and req.params.stop_token_ids == [9]
    assert req.num_prompt_tokens == 2


def test_limits_and_default_max_tokens():
    assert LIMITS.max_total_tokens == 200
    enc = encode_prompt([1] * 150, LIMITS)
    assert default_max_tokens(enc, LIMITS) == 50
    validate_request(enc, SamplingParams(max_tokens=50), LIMITS)
    too_long = encode_prompt([1] * 230, LIMITS)  # encodes: only the lengths check fails
    assert default_max_tokens(too_long, LIMITS) == 1
    with pytest.raises(InvalidRequestError, match="takes at most 199") as info:
        validate_request(too_long, SamplingParams(max_tokens=1), LIMITS)
    assert info.value.field == "prompt"


def test_engine_limits_come_from_its_configs():
    e = _engine()
    assert e.limits == EngineLimits(max_model_len=256, kv_cache_tokens=200, vocab_size=1000,
                                    max_num_seqs=256, block_size=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.limits.max_model_len = 1  # type: ignore[misc]


def test_engine_queues_a_validated_request_as_is():
    e = _engine(tokenizer=None)
    vreq = e.validate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), priority=2)
    assert isinstance(vreq, ValidatedRequest) and vreq.priority == 2
    rid = e.add_request("v", vreq)
    assert rid == "v" and e.stats().num_waiting == 1
    with pytest.raises(TypeError):
        e.add_request("w", vreq, SamplingParams())
    with pytest.raises(InvalidRequestError) as info:
        e.add_request("v", vreq)
    assert info.value.field == "request_id"
    done = {}
    while e.has_unfinished_requests():
        done.update({o.request_id: o for o in e.step() if o.finished})
    assert done["v"].prompt_token_ids == [5, 6, 7] and len(done["v"].token_ids) == 3
    assert done["v"].text == "" and done["v"].prompt is None


def test_stats_is_a_snapshot():
    e = _engine()
    e.add_request("a", list(range(1, 30)), SamplingParams(max_tokens=4))
    before = e.stats()
    e.step()
    after = e.stats()
    assert before.num_waiting == 1 and before.num_running == 0 and before.kv_usage == 0.0
    assert after.num_running == 1 and after.num_waiting == 0 and after.kv_usage > 0
    assert before.scheduler.num_steps == 0 and after.scheduler.num_steps == 1
    assert after.scheduler is not e.scheduler.stats
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.num_running = 0  # type: ignore[misc]
    while e.has_unfinished_requests():
        e.step()
    final = e.stats()
    assert final.num_unfinished == 0 and final.kv_usage == 0.0
    assert final.scheduler.finished_by_reason and not after.scheduler.finished_by_reason


@pytest.mark.parametrize("rid", ["", 7, b"r"])
def test_a_bad_request_id_is_refused_and_leaves_nothing(rid: object) -> None:
    e = _engine()
    with pytest.raises(InvalidRequestError, match="request_id") as info:
        e.add_request(rid, [1, 2], _params())  # type: ignore[arg-type]
    assert info.value.field == "request_id"
    assert not e.has_unfinished_requests() and e.scheduler.kv.num_used_blocks == 0
