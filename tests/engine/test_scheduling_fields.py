"""Scheduling fields at the engine's edge: tenant and SLO targets are validated once and reach the
``Request``; a request the scheduling policy rejects comes back once, with finish reason
``rejected`` and its error, and leaves nothing behind. Simulated executor: no model."""

from __future__ import annotations

from typing import Any

import pytest

from helpers import FakeClock
from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core import Scheduler
from kvloop.core.request import Request, RequestStatus
from kvloop.engine.intake import EngineLimits, validate_request
from kvloop.engine.llm import LLM
from kvloop.engine.llm_engine import LLMEngine
from kvloop.errors import InvalidRequestError
from kvloop.executor.simulated import (
    CostModel,
    SimulatedExecutor,
    get_hardware_spec,
    get_model_spec,
)
from kvloop.sampling_params import SamplingParams

LIMITS = EngineLimits(max_model_len=256, kv_cache_tokens=1024, vocab_size=1000)
PROMPT = list(range(1, 11))


def _engine() -> LLMEngine:
    clock = FakeClock()
    s = Scheduler(SchedulerConfig(max_model_len=256), CacheConfig(block_size=4,
                                                                  num_gpu_blocks=64), clock=clock)
    cost = CostModel(get_model_spec("smollm2-135m"), get_hardware_spec("l4"))
    return LLMEngine(s, SimulatedExecutor(cost, 4), vocab_size=1000, clock=clock)


def _reject(engine: LLMEngine, rid: str) -> None:
    """What policy ``slo`` with ``slo_overload="reject"`` does to a waiting request."""
    engine.scheduler.requests[rid].error = "cannot meet its TTFT target"
    assert engine.scheduler.finish_request(rid, RequestStatus.FINISHED_REJECTED)


def _drain(engine: LLMEngine, limit: int = 500) -> dict[str, list[Any]]:
    finals: dict[str, list[Any]] = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            engine.scheduler.check_invariants()
            if out.finished:
                finals.setdefault(out.request_id, []).append(out)
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv.num_used_blocks == 0
    return finals


def test_validated_request_carries_tenant_and_slo_targets() -> None:
    v = validate_request(PROMPT, None, LIMITS, tenant="acme", slo_ttft=0.5, slo_tpot=1)
    assert (v.tenant, v.slo_ttft, v.slo_tpot) == ("acme", 0.5, 1.0)
    assert isinstance(v.slo_tpot, float)
    v = validate_request(PROMPT, None, LIMITS)
    assert (v.tenant, v.slo_ttft, v.slo_tpot) == ("", None, None)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"tenant": "t" * 257}, "tenant"),
    ({"tenant": 3}, "tenant"),
    ({"slo_ttft": 0}, "slo_ttft"),
    ({"slo_ttft": -0.1}, "slo_ttft"),
    ({"slo_ttft": float("nan")}, "slo_ttft"),
    ({"slo_tpot": float("inf")}, "slo_tpot"),
    ({"slo_tpot": True}, "slo_tpot"),
    ({"slo_tpot": "1"}, "slo_tpot"),
    ({"slo_ttft": 2e9}, "slo_ttft"),
])
def test_bad_tenant_or_slo_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        validate_request(PROMPT, None, LIMITS, **kwargs)
    assert info.value.field == field and field in info.value.message


def test_add_request_passes_them_to_the_request() -> None:
    e = _engine()
    e.add_request("a", PROMPT, SamplingParams(max_tokens=3), tenant="acme", slo_ttft=0.25,
                  slo_tpot=0.05)
    e.add_request("b", e.validate(PROMPT, SamplingParams(max_tokens=3), tenant="zed"))
    reqs: dict[str, Request] = e.scheduler.requests
    assert (reqs["a"].tenant, reqs["a"].slo_ttft, reqs["a"].slo_tpot) == ("acme", 0.25, 0.05)
    assert (reqs["b"].tenant, reqs["b"].slo_ttft) == ("zed", None)
    with pytest.raises(TypeError, match="tenant"):
        e.add_request("c", e.validate(PROMPT), tenant="x")
    assert {k: v[0].finish_reason for k, v in _drain(e).items()} == {"a": "length",
                                                                     "b": "length"}


def test_rejected_waiting_request_is_reported_once_and_frees_everything() -> None:
    e = _engine()
    e.add_request("run", PROMPT, SamplingParams(max_tokens=20))
    e.step()  # "run" is running and holds blocks
    e.add_request("late", PROMPT * 3, SamplingParams(max_tokens=5), slo_ttft=1e-6)
    _reject(e, "late")
    finals = _drain(e)
    assert {k: len(v) for k, v in finals.items()} == {"run": 1, "late": 1}
    late = finals["late"][0]
    assert late.finish_reason == "rejected" and late.error == "cannot meet its TTFT target"
    assert late.token_ids == [] and late.num_output_tokens == 0
    assert e.scheduler.stats.finished_by_reason.get("rejected") == 1


def test_request_rejected_on_arrival_is_reported_by_the_next_step() -> None:
    e = _engine()
    add = e.scheduler.add_request

    def reject_on_arrival(request: Request) -> None:
        add(request)
        _reject(e, request.request_id)

    e.scheduler.add_request = reject_on_arrival  # type: ignore[method-assign]
    e.add_request("x", PROMPT, SamplingParams(max_tokens=4), slo_ttft=1e-6)
    assert e.has_unfinished_requests()
    outs = e.step()
    assert [(o.request_id, o.finish_reason, o.finished) for o in outs] == [
        ("x", "rejected", True)]
    assert not e.has_unfinished_requests() and e.step() == []


def _offline(engine: LLMEngine) -> LLM:
    """An ``LLM`` over ``engine`` (no model to load: the simulated executor)."""
    llm = LLM.__new__(LLM)
    llm.engine, llm.default_sampling, llm._trace_file = engine, {}, None
    return llm


def test_generate_takes_one_value_or_one_per_prompt() -> None:
    e = _engine()
    seen: list[Request] = []
    add = e.scheduler.add_request

    def spy(request: Request) -> None:
        seen.append(request)
        add(request)

    e.scheduler.add_request = spy  # type: ignore[method-assign]
    llm = _offline(e)
    params = SamplingParams(max_tokens=2)
    outs = llm.generate([PROMPT, PROMPT[:5]], params, use_tqdm=False, tenant="acme",
                        slo_ttft=[0.5, None], slo_tpot=0.1)
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert [(r.tenant, r.slo_ttft, r.slo_tpot) for r in seen] == [
        ("acme", 0.5, 0.1), ("acme", None, 0.1)]
    seen.clear()
    llm.generate([PROMPT, PROMPT], params, use_tqdm=False, tenant=["a", "b"])
    assert [r.tenant for r in seen] == ["a", "b"]
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([PROMPT, PROMPT], params, use_tqdm=False, tenant=["a"])
    assert info.value.field == "tenant"
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([PROMPT], params, use_tqdm=False, slo_tpot=[-1.0])
    assert info.value.field == "slo_tpot"
    assert not e.has_unfinished_requests()


def test_generate_returns_a_rejected_group_at_once() -> None:
    e = _engine()
    schedule = e.scheduler.schedule

    def rejecting() -> Any:
        for rid, req in list(e.scheduler.requests.items()):
            if req.tenant == "late" and req.status == RequestStatus.WAITING:
                _reject(e, rid)
        return schedule()

    e.scheduler.schedule = rejecting  # type: ignore[method-assign]
    outs = _offline(e).generate([PROMPT, PROMPT], SamplingParams(max_tokens=3, n=2),
                                use_tqdm=False, tenant=["late", "ok"])
    assert outs[0].finish_reason == "rejected" and outs[0].error
    assert [o.finish_reason for o in outs[0].outputs or []] == ["rejected"]
    assert outs[1].finish_reason == "length" and len(outs[1].outputs or []) == 2
    assert not e.has_unfinished_requests() and e.scheduler.kv.num_used_blocks == 0
