"""Each scheduling policy's ordering, admission and preemption decisions on hand-built
scenarios, the starvation bound, and cost-aware preemption."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import FakeClock, FakeExecutor, make_scheduler, req, run_all, step
from kvloop.core.policies import StepTimes


def _order(s, n_steps=1, ex=None, clock=None):
    """Ids first scheduled in the next ``n_steps`` steps, in order."""
    seen = []
    for _ in range(n_steps):
        out = step(s, ex, clock)
        seen += [rid for rid in out.num_scheduled_tokens if rid not in seen]
    return seen


# -- StepTimes -----------------------------------------------------------------------------
def test_step_times_fit_a_linear_cost_exactly():
    t = StepTimes()
    assert not t.ready
    for tokens in (1, 10, 50, 200, 7, 64):
        t.observe(tokens, 0.002 + 1e-4 * tokens)
    assert t.ready
    assert t.overhead_s == pytest.approx(0.002) and t.per_token_s == pytest.approx(1e-4)
    assert t.predict(100) == pytest.approx(0.012)
    assert t.prefill(250, 100) == pytest.approx(3 * 0.002 + 250 * 1e-4)
    assert t.tokens_within(0.012) == pytest.approx(100, abs=1)


def test_step_times_of_one_size_never_under_predict_larger_steps():
    t = StepTimes()
    for _ in range(6):
        t.observe(32, 0.01)
    assert t.predict(32) == pytest.approx(0.01) and t.predict(64) >= 0.02 - 1e-12


# -- priority with aging ---------------------------------------------------------------------
def test_priority_ages_a_waiting_request_ahead_of_newer_urgent_ones():
    clock = FakeClock()
    s = make_scheduler(clock=clock, policy="priority", aging_s=1.0, max_num_seqs=1)
    s.add_request(req("low", 4, 1, priority=3, arrival=0.0))
    clock.now = 2.0
    s.add_request(req("new-urgent", 4, 1, priority=0, arrival=2.0))  # key 2.0 < 3.0
    clock.now = 3.5
    s.add_request(req("late-urgent", 4, 1, priority=0, arrival=3.5))  # key 3.5 > 3.0
    assert _order(s, 3) == ["new-urgent", "low", "late-urgent"]


def test_strict_priority_without_aging():
    clock = FakeClock()
    s = make_scheduler(clock=clock, policy="priority", aging_s=0.0, max_num_seqs=1)
    s.add_request(req("low", 4, 1, priority=3, arrival=0.0))
    s.add_request(req("urgent", 4, 1, priority=0, arrival=100.0))
    assert _order(s, 2) == ["urgent", "low"]


_stream = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6), st.integers(1, 4)),
                   min_size=2, max_size=14)


def _serve_one_at_a_time(items, make, **sched):
    """One request at a time, one step per time unit; item ``i`` arrives at time ``i`` as
    ``make(rid, item, now)``. Returns the requests made."""
    clock = FakeClock()
    s = make_scheduler(clock=clock, max_num_seqs=1, max_num_batched_tokens=64, **sched)
    ex = FakeExecutor(step_time=1.0)
    made = []
    pending = list(enumerate(items))
    while pending or s.has_unfinished_requests():
        while pending and pending[0][0] <= clock.now:
            i, item = pending.pop(0)
            r = make(f"r{i}", item, clock.now)
            s.add_request(r)
            made.append(r)
        if s.has_unfinished_requests():
            step(s, ex, clock)
        else:
            clock.now += 1.0
        assert clock.now < 1000
    return made


def _prioritized(rid, item, now):
    prio, plen, out = item
    return req(rid, plen, out, priority=prio, arrival=now)


@settings(max_examples=60, deadline=None)
@given(items=_stream, aging=st.sampled_from([1.0, 2.0, 5.0]))
def test_priority_starvation_bound(items, aging):
    """With aging A, a request of priority p is admitted after at most the service of the
    requests that arrived up to (p - p_min) * A after it (one at a time, a step per unit,
    a request of P prompt tokens and T outputs takes T steps here): it never starves."""
    made = _serve_one_at_a_time(items, _prioritized, policy="priority", aging_s=aging)
    p_min = min(r.priority for r in made)
    for a in made:
        horizon = a.arrival_time + (a.priority - p_min) * aging
        ahead = [b for b in made if b is not a and b.arrival_time <= horizon]
        bound = sum(b.max_tokens for b in ahead) + a.max_tokens  # steps, one per unit
        assert a.finished_time - a.arrival_time <= bound + 1e-9, (a, bound)


def test_without_aging_a_low_priority_request_waits_for_the_whole_stream():
    # r1 (low) arrives while r0 runs, then a stream of urgent ones keeps coming
    items = [(0, 4, 2), (3, 4, 2)] + [(0, 4, 2)] * 12
    aged = {r.request_id: r
            for r in _serve_one_at_a_time(items, _prioritized, policy="priority", aging_s=1.0)}
    strict = {r.request_id: r
              for r in _serve_one_at_a_time(items, _prioritized, policy="priority", aging_s=0.0)}
    assert aged["r1"].first_scheduled_time <= 1.0 + 3 * 1.0 + 2  # its bound, one in service
    assert strict["r1"].first_scheduled_time > aged["r1"].first_scheduled_time + 10


class _Linear(FakeExecutor):
    """Steps of 10 ms plus 1 ms per token."""

    def execute(self, out):
        result = super().execute(out)
        result.step_time_s = 0.01 + 1e-3 * out.total_num_scheduled_tokens
        return result


# -- slo -----------------------------------------------------------------------------------
def test_slo_admits_the_tightest_deadline_first():
    clock = FakeClock()
    s = make_scheduler(clock=clock, policy="slo", slo_ttft=10.0, max_num_seqs=1)
    s.add_request(req("relaxed", 4, 1, arrival=0.0))  # due at 10
    s.add_request(req("tight", 4, 1, arrival=0.5, slo_ttft=1.0))  # due at 1.5
    s.add_request(req("default", 4, 1, arrival=1.0))  # due at 11
    assert _order(s, 3) == ["tight", "relaxed", "default"]


def test_slo_defers_a_request_that_can_no_longer_meet_its_ttft():
    clock = FakeClock()
    s = make_scheduler(clock=clock, policy="slo", slo_ttft=1.0, max_num_seqs=1, aging_s=100.0)
    s.add_request(req("busy", 4, 3, arrival=0.0))
    step(s, clock=clock)
    s.add_request(req("doomed", 4, 1, arrival=0.0, slo_ttft=0.001))  # already late
    s.add_request(req("fine", 4, 1, arrival=0.0))
    clock.now = 0.5
    seen = _order(s, 6, clock=clock)
    assert seen.index("fine") < seen.index("doomed")
    run_all(s)
    assert s.stats.finished_by_reason == {"length": 3}


def test_slo_serves_a_deferred_request_first_once_it_is_aging_s_late():
    clock = FakeClock()
    s = make_scheduler(clock=clock, policy="slo", slo_ttft=1.0, max_num_seqs=1, aging_s=2.0)
    s.add_request(req("doomed", 4, 1, arrival=0.0, slo_ttft=0.001))
    clock.now = 5.0  # past its deadline by more than aging_s
    s.add_request(req("fresh", 4, 1, arrival=5.0))
    assert _order(s, 1) == ["doomed"]


def test_slo_rejects_late_requests_and_frees_everything():
    clock = FakeClock()
    s = make_scheduler(clock=clock, policy="slo", slo_ttft=1.0, slo_overload="reject",
                       max_num_seqs=1)
    s.add_request(req("first", 4, 3, arrival=0.0))
    s.add_request(req("second", 4, 1, arrival=0.0))
    ex = FakeExecutor(step_time=0.6)
    out = step(s, ex, clock)
    assert list(out.num_scheduled_tokens) == ["first"]
    while s.has_unfinished_requests():
        step(s, ex, clock)
    assert s.stats.finished_by_reason == {"length": 1, "rejected": 1}
    assert s.kv.num_used_blocks == 0 and not s.requests
    assert not s.policy._latest_start  # nothing kept about finished requests


def test_slo_caps_the_step_to_keep_running_decodes_within_tpot():
    clock = FakeClock()
    s = make_scheduler(clock=clock, policy="slo", slo_ttft=100.0, slo_tpot=0.05,
                       max_num_batched_tokens=512, num_gpu_blocks=512, max_model_len=2048)

    ex = _Linear()
    s.add_request(req("chat", 8, 200, arrival=0.0))
    for i in range(6):  # warm up the step-time model with prompts of several sizes
        s.add_request(req(f"warm{i}", 16 + 40 * i, 1, arrival=0.0))
        step(s, ex, clock)
    s.add_request(req("long", 1500, 1, arrival=clock.now))
    out = step(s, ex, clock)
    # 0.05 s allows (0.05 - 0.01) / 1e-3 = 40 tokens, not the 512 budget
    assert out.total_num_scheduled_tokens <= 40 + 1
    assert out.num_scheduled_tokens["chat"] == 1 and out.total_num_scheduled_tokens > 1
    assert out.total_num_scheduled_tokens == 40  # the prompt work still gets the rest


# -- fair ----------------------------------------------------------------------------------
def test_fair_admits_the_least_served_tenant_first():
    s = make_scheduler(policy="fair", max_num_seqs=1)
    for i in range(4):
        s.add_request(req(f"heavy{i}", 8, 4, tenant="heavy", arrival=0.0))
    s.add_request(req("light0", 8, 4, tenant="light", arrival=1.0))
    order = _order(s, 30)
    assert order[:3] == ["heavy0", "light0", "heavy1"]


def test_fair_weights_give_proportional_service():
    s = make_scheduler(policy="fair", max_num_seqs=1, tenant_weights=(("gold", 3.0),))
    for i in range(12):
        s.add_request(req(f"g{i}", 8, 4, tenant="gold"))
        s.add_request(req(f"f{i}", 8, 4, tenant="free"))
    order = _order(s, 40)
    first8 = [rid[0] for rid in order[:8]]
    assert first8.count("g") == 6 and first8.count("f") == 2


def test_fair_lifts_a_returning_tenant_so_idling_banks_no_credit():
    s = make_scheduler(policy="fair", max_num_seqs=1)
    s.add_request(req("a0", 8, 4, tenant="a"))
    s.add_request(req("a1", 8, 4, tenant="a"))
    for _ in range(12):
        step(s)
    assert s.policy.counters["a"] > 0 and "b" not in s.policy.counters
    s.add_request(req("b0", 8, 4, tenant="b"))
    assert s.policy.counters["b"] == s.policy.counters["a"]  # lifted, no banked credit


def test_fair_does_not_charge_recomputed_prompt_tokens():
    s = make_scheduler(policy="fair", num_gpu_blocks=6, block_size=4, max_num_batched_tokens=64,
                       cost_aware_preemption=False)  # newest-first: it must preempt
    s.add_request(req("a", 8, 12, tenant="a"))
    s.add_request(req("b", 8, 12, tenant="b"))
    run_all(s)
    assert s.stats.num_recompute_preemptions > 0
    # each tenant: 8 prompt tokens + 2 per output token, whatever was recomputed
    assert s.policy.counters == {"a": 8 + 2 * 12, "b": 8 + 2 * 12}


# -- cost-aware preemption -------------------------------------------------------------------
def _overflowing(cost_aware: bool, **kw):
    """Four requests whose outputs outgrow a small pool when all are admitted at once."""
    s = make_scheduler(num_gpu_blocks=16, block_size=4, max_num_batched_tokens=128,
                       cost_aware_preemption=cost_aware, enable_prefix_caching=False, **kw)
    for i in range(4):
        s.add_request(req(f"r{i}", 6, 24, arrival=float(i)))  # 30 tokens: 8 blocks each
    run_all(s)
    return s


def test_admission_headroom_avoids_preempting_and_recomputing():
    newest = _overflowing(cost_aware=False)
    cost = _overflowing(cost_aware=True)
    assert newest.stats.num_preemptions > 0 and newest.stats.num_recomputed_tokens > 0
    assert cost.stats.num_preemptions < newest.stats.num_preemptions
    assert cost.stats.num_recomputed_tokens < newest.stats.num_recomputed_tokens


def test_headroom_only_reserves_what_max_tokens_allows():
    # short outputs need no headroom: all are admitted at once, as without cost-awareness
    s = make_scheduler(num_gpu_blocks=16, block_size=4, max_num_batched_tokens=128)
    for i in range(4):
        s.add_request(req(f"r{i}", 8, 1, arrival=float(i)))
    out = step(s)
    assert len(out.num_scheduled_tokens) == 4


def _second_admitted(
    first: tuple[str, int, int], second: tuple[str, int, int], cost_aware: bool, **cfg: object
) -> tuple[bool, object]:
    """Run ``first`` one step, add ``second``: was it admitted at once, and the stats once
    both finished. Requests are (id, prompt tokens, max tokens); pool of 16 blocks of 4."""
    s = make_scheduler(num_gpu_blocks=16, block_size=4, enable_prefix_caching=False,
                       cost_aware_preemption=cost_aware, **cfg)
    s.add_request(req(*first, arrival=0.0))
    step(s)
    s.add_request(req(*second, arrival=1.0))
    admitted = second[0] in step(s).num_scheduled_tokens
    run_all(s)
    return admitted, s.stats


def test_admission_counts_a_long_prompt_whole_not_its_first_chunk():
    # decoding grows to 8 blocks; long needs 12 (40 prompt + 8 output tokens) of the 16.
    # Its first 7-token chunk fits, but admitted on it alone, its later chunks take the
    # blocks decoding grows into and someone is preempted; cost-aware waits instead.
    pair = (("decoding", 8, 24), ("long", 40, 8))
    admitted, newest = _second_admitted(*pair, cost_aware=False, max_num_batched_tokens=8)
    assert admitted and newest.num_preemptions > 0 and newest.num_recomputed_tokens > 0
    admitted, cost = _second_admitted(*pair, cost_aware=True, max_num_batched_tokens=8)
    assert not admitted  # 12 blocks + decoding's headroom do not fit the 14 free
    assert cost.num_preemptions == 0 and cost.num_recomputed_tokens == 0


def test_admission_reserves_the_rest_of_a_running_prompt():
    # long (32 + 8 tokens, 10 blocks) has 4 blocks after its first chunk and needs 4 more
    # for its prompt. second's first chunk (4 blocks) and even its whole prompt (7) fit
    # the 12 free blocks, but not beside long's 4 and long's headroom (2): it waits.
    pair = (("long", 32, 8), ("second", 28, 8))
    cfg = {"max_num_batched_tokens": 16, "max_num_partial_prefills": 2,
           "scheduling_order": "prefill-first"}
    admitted, newest = _second_admitted(*pair, cost_aware=False, **cfg)
    assert admitted and newest.num_preemptions > 0
    admitted, cost = _second_admitted(*pair, cost_aware=True, **cfg)
    assert not admitted
    assert cost.num_preemptions == 0 and cost.num_recomputed_tokens == 0


def test_a_victim_that_frees_nothing_is_passed_over():
    from kvloop.core.step import StepBuilder

    s = make_scheduler(num_gpu_blocks=40, block_size=4, max_num_batched_tokens=256)
    rs = [req(f"r{i}", 6, 8, arrival=float(i)) for i in range(3)]
    for r in rs:
        s.add_request(r)
    step(s)
    shared = s.kv.req_blocks["r2"]
    for blk in shared:  # as if every block of the newest were shared with someone else
        blk.ref_cnt += 1
    try:
        assert s.kv.num_freeable_blocks(rs[2]) == 0
        assert s._pick_victim(StepBuilder(64, 0.0), worse_than=None) is rs[1]
    finally:
        for blk in shared:
            blk.ref_cnt -= 1
    assert s._pick_victim(StepBuilder(64, 0.0), worse_than=None) is rs[2]


def test_cost_aware_waits_for_a_request_that_finishes_this_step():
    # ending: 8 + 2 tokens, so its headroom is one block and growing is admitted beside it
    s = make_scheduler(num_gpu_blocks=5, block_size=4, max_num_batched_tokens=64,
                       enable_prefix_caching=False)
    s.add_request(req("ending", 8, 2, arrival=0.0))  # a 3rd block for its last step
    s.add_request(req("growing", 8, 6, arrival=1.0))  # a 3rd block at its 2nd step
    run_all(s)
    assert s.stats.num_preemptions == 0 and s.stats.num_preemptions_avoided >= 1
    s2 = make_scheduler(num_gpu_blocks=5, block_size=4, max_num_batched_tokens=64,
                        enable_prefix_caching=False, cost_aware_preemption=False)
    s2.add_request(req("ending", 8, 2, arrival=0.0))
    s2.add_request(req("growing", 8, 6, arrival=1.0))
    run_all(s2)
    assert s2.stats.num_preemptions >= 1


def test_a_request_preempted_max_preemptions_times_is_spared():
    s = make_scheduler(num_gpu_blocks=40, block_size=4, max_num_batched_tokens=256,
                       max_preemptions=1, enable_prefix_caching=False)
    cands = [req(f"c{i}", 4, 8, arrival=float(i)) for i in range(3)]
    for r in cands:
        s.add_request(r)
    step(s)
    cands[2].num_preemptions = 1  # the newest has had its turn
    from kvloop.core.step import StepBuilder

    victim = s._pick_victim(StepBuilder(64, 0.0), worse_than=None)
    assert victim is cands[1]
    s.config = s.config.__class__(**{**s.config.__dict__, "cost_aware_preemption": False})
    assert s._pick_victim(StepBuilder(64, 0.0), worse_than=None) is cands[2]


def test_cost_aware_swap_recomputes_a_victim_with_one_block_of_work():
    from kvloop.core.step import StepBuilder

    for cost_aware, expected in ((True, "recompute"), (False, "swap")):
        s = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=16, block_size=4,
                           max_num_batched_tokens=64, preemption_mode="swap",
                           cost_aware_preemption=cost_aware)
        tiny = req("tiny", 3, 8)
        s.add_request(tiny)
        step(s)
        assert 0 < tiny.num_computed_tokens <= 4
        b = StepBuilder(64, 0.0)
        s._preempt(tiny, b)
        assert b.preempted == [("tiny", expected)]


_slo_stream = st.lists(
    st.tuples(st.sampled_from([None, 0.5, 2.0, 8.0]), st.integers(1, 6), st.integers(1, 4)),
    min_size=2, max_size=14)


@settings(max_examples=60, deadline=None)
@given(items=_slo_stream, aging=st.sampled_from([1.0, 3.0]))
def test_slo_starvation_bound(items, aging):
    """Under slo (defer), a request due at D starts by D + aging_s plus the service of the
    requests that arrived up to then (one at a time, a step per time unit): none starves,
    however many tighter requests keep arriving."""
    def make(rid, item, now):
        ttft, plen, out = item
        return req(rid, plen, out, arrival=now, slo_ttft=ttft)

    made = _serve_one_at_a_time(items, make, policy="slo", slo_ttft=4.0, aging_s=aging)
    for a in made:
        due = a.arrival_time + (a.slo_ttft or 4.0)
        horizon = due + aging
        ahead = [b for b in made if b is not a and b.arrival_time <= horizon]
        bound = horizon + sum(b.max_tokens for b in ahead)
        assert a.first_scheduled_time <= bound + 1e-9, (a, bound)


def test_slo_lets_a_step_spend_the_tpot_slack_a_decode_has_banked():
    clock = FakeClock()
    s = make_scheduler(clock=clock, policy="slo", slo_ttft=100.0, slo_tpot=0.05,
                       max_num_batched_tokens=512, num_gpu_blocks=512, max_model_len=2048)

    ex = _Linear()
    s.add_request(req("chat", 40, 200, arrival=0.0))
    s.add_request(req("warm", 8, 1, arrival=0.0))
    for _ in range(20):  # 11 ms decode steps bank ~39 ms each against a 50 ms target
        step(s, ex, clock)
    s.add_request(req("long", 1500, 1, arrival=clock.now))
    out = step(s, ex, clock)
    assert out.total_num_scheduled_tokens == 512  # no cap: the slack covers a 0.52 s step
