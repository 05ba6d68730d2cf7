"""LLMEngine over the simulated executor: the same engine, no model behind it."""

import pytest

from helpers import FakeClock
from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core import Scheduler
from kvloop.engine.llm_engine import LLMEngine
from kvloop.executor.simulated import (
    CostModel,
    SimulatedExecutor,
    get_hardware_spec,
    get_model_spec,
)
from kvloop.sampling_params import SamplingParams


def _engine(num_gpu_blocks=64, executor=None, **sched):
    clock = FakeClock()
    s = Scheduler(
        SchedulerConfig(**({"max_model_len": 256} | sched)),
        CacheConfig(block_size=4, num_gpu_blocks=num_gpu_blocks),
        clock=clock,
    )
    cost = CostModel(get_model_spec("smollm2-135m"), get_hardware_spec("l4"))
    ex = executor or SimulatedExecutor(cost, 4)
    return LLMEngine(s, ex, vocab_size=1000, clock=clock)


def _drain(engine, limit=500):
    done = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv.num_used_blocks == 0
    return done


def test_requests_run_to_their_length():
    e = _engine()
    for n in (3, 7, 12):
        e.add_request(f"r{n}", list(range(1, 10 + n)), SamplingParams(max_tokens=n))
    done = _drain(e)
    assert {k: len(v.token_ids) for k, v in done.items()} == {"r3": 3, "r7": 7, "r12": 12}
    assert all(v.finish_reason == "length" for v in done.values())
    assert all(v.metrics.ttft <= v.metrics.e2e for v in done.values())


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], SamplingParams(), "prompt"),
        ("text", SamplingParams(), "token ids"),
        ([5000], SamplingParams(), "prompt_token_ids"),
        (list(range(1, 300)), SamplingParams(), "max_model_len"),
        (list(range(1, 200)), SamplingParams(max_tokens=100), "max_tokens"),
    ],
)
def test_bad_input_raises_and_leaves_engine_serving(prompt, params, field):
    e = _engine()
    e.add_request("good", [1, 2, 3], SamplingParams(max_tokens=4))
    e.step()
    with pytest.raises(ValueError, match=field):
        e.add_request("bad", prompt, params)
    e.scheduler.check_invariants()
    assert set(_drain(e)) == {"good"}


def test_bad_sampling_values_name_the_field():
    for kw, field in [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    e = _engine()
    p = SamplingParams()
    p.temperature = -2  # mutated after construction: still caught at the engine
    with pytest.raises(ValueError, match="temperature"):
        e.add_request("x", [1, 2], p)
    assert not e.has_unfinished_requests()


def test_abort_in_flight_frees_blocks():
    e = _engine()
    e.add_request("a", list(range(1, 30)), SamplingParams(max_tokens=50))
    e.add_request("b", list(range(1, 30)), SamplingParams(max_tokens=5))
    e.step()
    out = e.abort_request("a")
    assert out.finished and out.finish_reason == "abort"
    assert e.abort_request("a") is None
    assert set(_drain(e)) == {"b"}


class _Exploding:
    def __init__(self, inner, fail_steps):
        self.inner, self.fail_steps, self.n = inner, fail_steps, 0

    def execute(self, out):
        self.n += 1
        if self.n in self.fail_steps and out.num_scheduled_tokens:
            raise RuntimeError("kernel fell over")
        return self.inner.execute(out)


def test_failed_step_fails_its_requests_and_the_engine_goes_on():
    cost = CostModel(get_model_spec("smollm2-135m"), get_hardware_spec("l4"))
    e = _engine(executor=_Exploding(SimulatedExecutor(cost, 4), {2}))
    e.add_request("a", [1, 2, 3], SamplingParams(max_tokens=5))
    e.step()
    outs = e.step()
    assert [o.finish_reason for o in outs] == ["error"]
    assert "kernel fell over" in outs[0].error
    e.add_request("b", [1, 2, 3], SamplingParams(max_tokens=5))
    done = _drain(e)
    assert done["b"].finish_reason == "length"


def test_step_outputs_are_deltas_and_the_final_one_is_whole():
    e = _engine()
    prompt = list(range(1, 40))
    e.add_request("r", prompt, SamplingParams(max_tokens=9, ignore_eos=True))
    seen: list[int] = []
    final = None
    while e.has_unfinished_requests():
        for out in e.step():
            seen.extend(out.new_token_ids)
            assert out.num_output_tokens == len(seen) and out.num_prompt_tokens == len(prompt)
            if out.finished:
                final = out
            else:  # NOTE: no per-step copy of the prompt or the output so far
                assert out.token_ids is None and out.prompt_token_ids is None
                assert out.text is None and out.metrics is None and out.logprobs is None
                snap = e.snapshot("r")
                assert snap.token_ids == seen and snap.prompt_token_ids == prompt
    assert final is not None and final.token_ids == seen and len(seen) == 9
    assert final.prompt_token_ids == prompt
    assert final.metrics is not None and e.snapshot("r") is None


class _BrokenDetokenizer:
    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def add(self, ids):
        if self.fail:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return "x" * len(ids), False

    def flush(self):
        return ""


class _Tokenizer:
    """Detokenizers that raise for prompts starting with token 13."""

    def detokenizer(self, ids, params):
        return _BrokenDetokenizer(ids[0] == 13)


def test_an_engine_error_on_one_request_fails_that_request_only():
    e = _engine()
    e.tokenizer = _Tokenizer()
    e.add_request("bad", [13, 5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    e.add_request("good", [14, 5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    done = _drain(e)
    assert done["bad"].finish_reason == "error" and "UnicodeDecodeError" in done["bad"].error
    assert done["good"].finish_reason == "length" and done["good"].text == "xxxx"
    e.scheduler.check_invariants()


def test_a_request_the_scheduler_refuses_is_an_error_not_a_hang():
    from kvloop.engine.intake import EngineLimits, validate_request
    from kvloop.errors import InvalidRequestError

    e = _engine(num_gpu_blocks=4)
    big = validate_request([5] * 10, SamplingParams(max_tokens=20), EngineLimits(256, 10**6))
    with pytest.raises(InvalidRequestError) as err:
        e.add_request("r", big)
    assert err.value.field == "max_tokens" and "KV blocks" in str(err.value)
    assert not e.has_unfinished_requests() and e.scheduler.kv.num_used_blocks == 0
