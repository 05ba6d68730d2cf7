"""Length-aware policies (sjf, mlfq), output-length predictors and the balanced policy."""

import random

import pytest
from scipy.stats import kendalltau

from helpers import FakeClock, FakeExecutor, make_scheduler, req, step
from kvloop.config import SchedulerConfig
from kvloop.core.policies import PREDICTORS, make_predictor
from kvloop.core.policies.length import WORK_CAP, mlfq_level, work_scale
from kvloop.core.request import Request, RequestStatus
from kvloop.sampling_params import SamplingParams


def _order(s, n_steps, clock=None):
    seen = []
    for _ in range(n_steps):
        out = step(s, None, clock)
        seen += [rid for rid in out.num_scheduled_tokens if rid not in seen]
    return seen


def test_sjf_oracle_runs_the_shortest_predicted_first():
    s = make_scheduler(policy="sjf", length_predictor="oracle", max_num_seqs=1)
    s.add_request(req("long", 4, 40))
    s.add_request(req("short", 4, 2))
    s.add_request(req("mid", 4, 10))
    assert _order(s, 60) == ["short", "mid", "long"]


def test_sjf_without_aging_is_a_strict_order():
    s = make_scheduler(policy="sjf", length_predictor="oracle", aging_s=0.0, max_num_seqs=1)
    s.add_request(req("long", 4, 40, arrival=0.0))
    s.add_request(req("short", 4, 2, arrival=1e6))
    assert _order(s, 50) == ["short", "long"]


def test_sjf_aging_bound_no_overtaking_by_much_later_arrivals():
    """With one seat and a stream of short requests, a long one is never passed by a
    request that arrived more than aging_s after it."""
    clock = FakeClock()
    aging = 3.0
    s = make_scheduler(clock=clock, policy="sjf", length_predictor="oracle", aging_s=aging,
                       max_num_seqs=1, max_num_batched_tokens=64)
    ex = FakeExecutor(step_time=1.0)
    rng = random.Random(0)
    made = {}
    for i in range(40):
        out_len = 30 if i % 7 == 0 else rng.randint(1, 3)
        r = req(f"r{i}", 4, out_len, arrival=clock.now)
        made[r.request_id] = r
        s.add_request(r)
        step(s, ex, clock)
    while s.has_unfinished_requests():
        step(s, ex, clock)
    reqs = sorted(made.values(), key=lambda r: r.first_scheduled_time)
    for i, a in enumerate(reqs):
        for b in reqs[:i]:  # b started before a
            assert b.arrival_time <= a.arrival_time + aging, (a.request_id, b.request_id)
    assert [r.request_id for r in reqs][:1] == ["r0"]


def test_mlfq_skip_join_and_demotion():
    assert mlfq_level(Request("a", [1] * 10, SamplingParams(max_tokens=4))) == 0
    long_prompt = Request("b", [1] * 5000, SamplingParams(max_tokens=4))
    assert mlfq_level(long_prompt) == 5  # 5000 / 256 -> ceil(log2(19.5)) = 5
    r = Request("c", [1] * 10, SamplingParams(max_tokens=100))
    r.output_token_ids.extend([0] * 50)  # 10 + 16 * 50 = 810 units
    assert mlfq_level(r) == 2
    assert work_scale(1.0) == 0.0 and work_scale(WORK_CAP * 2) == 1.0
    s = make_scheduler(policy="mlfq", max_num_seqs=1, max_num_batched_tokens=2048,
                       max_model_len=4096, num_gpu_blocks=2000)
    s.add_request(req("long-prompt", 1500, 2))
    s.add_request(req("short-prompt", 8, 2))
    assert _order(s, 10) == ["short-prompt", "long-prompt"]


def _finished(rid: str, prompt: int, out: int, tenant: str = "") -> Request:
    r = Request(rid, [1] * prompt, SamplingParams(max_tokens=out), tenant=tenant)
    r.output_token_ids.extend([0] * out)
    r.status = RequestStatus.FINISHED_LENGTH
    return r


@pytest.mark.parametrize("tau", [0.2, 0.5, 0.8])
def test_noisy_oracle_hits_its_kendall_tau(tau):
    rng = random.Random(1)
    p = make_predictor("noisy", tau)
    for i in range(3000):
        r = _finished(f"r{i}", 10, int(rng.lognormvariate(5, 1)) + 1)
        p.predict(r)
        p.forget(r)
    predicted, true = zip(*p.pairs, strict=True)
    assert kendalltau(predicted, true).statistic == pytest.approx(tau, abs=0.05)


def test_history_predictor_learns_by_prompt_length():
    p = make_predictor("history", 1.0)
    assert p.predict(_finished("first", 10, 5)) == 256.0  # the prior
    for i in range(20):
        p.forget(_finished(f"s{i}", 10, 8, tenant="x"))  # short prompts: 8 tokens out
        p.forget(_finished(f"l{i}", 3000, 400, tenant="x"))
    assert p.predict(_finished("a", 12, 1)) == pytest.approx(8.0)
    assert p.predict(_finished("b", 2500, 1, tenant="new")) == pytest.approx(400.0)
    assert set(PREDICTORS) == {"oracle", "noisy", "history"}


def test_predictor_pairs_record_completed_requests_only():
    p = make_predictor("oracle", 1.0)
    done, aborted = _finished("d", 4, 7), _finished("x", 4, 7)
    aborted.status = RequestStatus.FINISHED_ABORTED
    for r in (done, aborted):
        p.predict(r)
        p.forget(r)
    assert p.pairs == [(7.0, 7)]


def test_balanced_prefers_near_deadline_short_work_within_fair_slack():
    clock = FakeClock()
    s = make_scheduler(clock=clock, policy="balanced", slo_ttft=10.0, length_predictor="oracle",
                       max_num_seqs=1, max_num_batched_tokens=16)
    s.add_request(req("a-long", 4, 30, tenant="a"))
    s.add_request(req("a-short", 4, 2, tenant="a"))
    s.add_request(req("b-short", 4, 2, tenant="b"))
    order = _order(s, 80, clock)
    assert order.index("a-short") < order.index("a-long")
    assert order.index("b-short") < order.index("a-long")
    s.check_invariants()


def test_balanced_fair_share_bounds_a_heavy_tenant():
    """A heavy tenant far ahead of its share is not served while a light one waits."""
    clock = FakeClock()
    s = make_scheduler(clock=clock, policy="balanced", slo_ttft=100.0, max_num_seqs=1,
                       max_num_batched_tokens=8, num_gpu_blocks=256)
    s.policy.fair.counters.update({"heavy": 1000.0, "light": 0.0})
    s.add_request(req("l", 4, 20, tenant="light"))  # longer: behind h by urgency alone
    s.add_request(req("h", 4, 2, tenant="heavy"))
    assert _order(s, 3, clock)[0] == "l"


@pytest.mark.parametrize(("field", "value", "match"), [
    ("length_predictor", "magic", "length_predictor must be one of"),
    ("predictor_tau", 1.5, "predictor_tau must be a number in"),
])
def test_bad_predictor_config_names_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**{field: value})


def test_balanced_needs_a_ttft_target():
    with pytest.raises(ValueError, match="'balanced' needs a default TTFT target"):
        SchedulerConfig(policy="balanced")
