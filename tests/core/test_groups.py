"""Parallel sampling in the scheduler: a group forks after its leader's prefill, shares the
prompt's blocks, copies the partial one, and is admitted and preempted as one unit."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import FakeExecutor, make_scheduler, req
from kvloop.core import Request
from kvloop.sampling_params import SamplingParams


def _group(rid: str, prompt_len: int, n: int, max_tokens: int = 4, **kw: object) -> Request:
    r = req(rid, prompt_len, max_tokens)
    r.sampling_params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True, **kw)
    return r


def _step(s, ex=None):
    ex = ex or FakeExecutor()
    out = s.schedule()
    s.update_from_output(out, ex.execute(out))
    s.check_invariants()
    return out


def test_a_group_shares_the_prompt_and_copies_the_partial_block():
    s = make_scheduler(block_size=4, num_gpu_blocks=32)
    s.add_request(_group("g", 10, 3))
    first = _step(s)
    assert first.num_scheduled_tokens == {"g": 9}  # all but the last prompt token
    fork = s.schedule()
    assert fork.num_scheduled_tokens == {"g": 1, "g#1": 1, "g#2": 1}
    assert {d.request_id for d in fork.new_requests} == {"g#1", "g#2"}
    leader_blocks = s.kv.block_ids("g")
    for d in fork.new_requests:
        assert d.num_computed_tokens == 9
        assert d.block_ids[:2] == leader_blocks[:2]  # the two full prompt blocks, shared
        assert d.block_ids[2] != leader_blocks[2]  # the partial block, copied
    assert sorted(fork.blocks_to_copy) == sorted(
        (leader_blocks[2], d.block_ids[2]) for d in fork.new_requests)
    assert all(s.kv.pool.blocks[b].ref_cnt == 3 for b in leader_blocks[:2])
    s.update_from_output(fork, FakeExecutor().execute(fork))
    s.check_invariants()
    for _ in range(10):
        if not s.has_unfinished_requests():
            break
        _step(s)
    assert not s.has_unfinished_requests()
    assert s.kv.num_used_blocks == 0  # shared blocks freed exactly once (invariants hold)
    assert s.stats.finished_by_reason == {"length": 3}


def test_a_group_at_a_block_boundary_copies_nothing():
    s = make_scheduler(block_size=4, num_gpu_blocks=32)
    s.add_request(_group("g", 9, 2))
    _step(s)
    fork = s.schedule()
    assert not fork.blocks_to_copy
    (child,) = fork.new_requests
    assert child.block_ids[:2] == s.kv.block_ids("g")[:2] and len(child.block_ids) == 3
    s.update_from_output(fork, FakeExecutor().execute(fork))
    s.check_invariants()


def test_a_one_token_prompt_forks_at_admission():
    s = make_scheduler(block_size=4, num_gpu_blocks=32)
    s.add_request(_group("g", 1, 3))
    out = _step(s)
    assert out.num_scheduled_tokens == {"g": 1, "g#1": 1, "g#2": 1}
    assert {d.request_id for d in out.new_requests} == {"g", "g#1", "g#2"}


def test_a_group_is_admitted_only_with_seats_for_all():
    s = make_scheduler(block_size=4, num_gpu_blocks=64, max_num_seqs=4)
    s.add_request(req("a", 4, 8))
    s.add_request(req("b", 4, 8))
    s.add_request(_group("g", 6, 3))
    out = _step(s)
    assert set(out.num_scheduled_tokens) == {"a", "b"}  # g needs 3 of the 4 seats
    s2 = make_scheduler(block_size=4, num_gpu_blocks=64, max_num_seqs=2)
    refused = _group("g", 6, 3)
    s2.add_request(refused)
    assert refused.error and "max_num_seqs" in refused.error


def test_a_group_is_preempted_as_one_unit_and_still_finishes():
    for mode in ("recompute", "swap"):
        # early needs 5 blocks, the group up to 1 shared + 3 x 4: more than 14 together.
        s = make_scheduler(block_size=4, num_gpu_blocks=14, num_cpu_blocks=64,
                           preemption_mode=mode, max_num_batched_tokens=64,
                           cost_aware_preemption=False)  # the newest (the group) goes
        s.add_request(req("early", 6, 12))
        s.add_request(_group("g", 6, 3, max_tokens=12))
        preempted_together = False
        for _ in range(200):
            if not s.has_unfinished_requests():
                break
            out = _step(s)
            group_ids = {"g", "g#1", "g#2"}
            hit = group_ids & set(out.preempted_request_ids)
            if hit:
                running_ids = {r.request_id for r in s.running}
                assert not (group_ids & running_ids), "part of a group kept running"
                preempted_together = True
        assert not s.has_unfinished_requests(), mode
        assert preempted_together, mode
        assert s.kv.num_used_blocks == 0 and s.stats.finished_by_reason == {"length": 4}


def test_seeded_siblings_get_distinct_seeds():
    s = make_scheduler(block_size=4, num_gpu_blocks=32)
    s.add_request(_group("g", 6, 3, seed=7, temperature=1.0))
    _step(s)
    _step(s)
    seeds = {r.request_id: r.sampling_params.seed for r in s.running}
    assert seeds == {"g": 7, "g#1": 8, "g#2": 9}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    setup=st.fixed_dictionaries({
        "block_size": st.sampled_from([1, 2, 4]),
        "num_gpu_blocks": st.integers(40, 80),
        "num_cpu_blocks": st.integers(0, 30),
        "max_num_batched_tokens": st.integers(8, 48),
        "max_num_seqs": st.integers(3, 8),
        "max_model_len": st.just(48),
        "preemption_mode": st.sampled_from(["recompute", "swap"]),
        "scheduling_order": st.sampled_from(["decode-first", "prefill-first"]),
        "enable_prefix_caching": st.booleans(),
        "policy": st.sampled_from(["fcfs", "priority"]),
    }),
    work=st.lists(st.tuples(st.integers(0, 8), st.integers(1, 16), st.integers(1, 14),
                            st.integers(1, 3), st.integers(0, 2)), min_size=1, max_size=8),
)
def test_random_groups_drain_without_leaks(setup, work):
    s = make_scheduler(**setup)
    ex = FakeExecutor()
    reqs = []
    for step in range(400):
        for j, (at, plen, mt, n, prio) in enumerate(work):
            if at == step:
                r = _group(f"r{j}", plen, n, max_tokens=mt) if n > 1 else req(f"r{j}", plen, mt)
                r.priority = prio
                s.add_request(r)
                reqs.append(r)
        if step > 8 and not s.has_unfinished_requests():
            break
        out = s.schedule()
        s.update_from_output(out, ex.execute(out))
        s.check_invariants()
    assert not s.has_unfinished_requests(), "did not drain"
    assert s.kv.num_used_blocks == 0
    for r in reqs:
        members = r.group.members if r.group is not None and r.group.forked else [r]
        for m in members:
            assert m.error or len(m.output_token_ids) == m.sampling_params.max_tokens
        if r.group is not None and not r.error:
            assert r.group.forked and len(r.group.members) == r.sampling_params.n
