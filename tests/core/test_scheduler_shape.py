"""The scheduler's shape: the bulk decode path decides what the per-request loop decides,
and partial prefills are counted once, whatever the order of the passes."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvloop.core.scheduler as scheduler_module
from helpers import FakeExecutor, make_scheduler, req


def _trace(setup: dict, workload: list[tuple[int, int, int]], steps: int = 80) -> list:
    """Every step's decisions for ``workload`` (arrival step, prompt len, max tokens)."""
    s = make_scheduler(**setup)
    ex = FakeExecutor()
    decisions = []
    for i in range(steps):
        for j, (arrive, prompt_len, max_tokens) in enumerate(workload):
            if arrive == i:
                s.add_request(req(f"r{j}", prompt_len, max_tokens))
        out = s.schedule()
        c = out.cached_requests
        decisions.append((
            dict(out.num_scheduled_tokens),
            [(d.request_id, d.block_ids, d.num_computed_tokens) for d in out.new_requests],
            list(zip(c.request_ids, c.new_block_ids, c.num_computed_tokens,
                     c.resumed_from_swap, strict=True)),
            out.blocks_to_swap_in, out.blocks_to_swap_out, out.preempted_request_ids,
        ))
        s.update_from_output(out, ex.execute(out))
        s.check_invariants()
    return decisions


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    setup=st.fixed_dictionaries({
        "block_size": st.sampled_from([1, 2, 4]),
        "num_gpu_blocks": st.integers(24, 64),
        "num_cpu_blocks": st.integers(0, 16),
        "max_num_batched_tokens": st.integers(6, 40),
        "max_num_seqs": st.integers(1, 8),
        "max_model_len": st.just(48),
        "preemption_mode": st.sampled_from(["recompute", "swap"]),
        "scheduling_order": st.sampled_from(["decode-first", "prefill-first"]),
        "enable_prefix_caching": st.booleans(),
    }),
    workload=st.lists(st.tuples(st.integers(0, 10), st.integers(1, 20), st.integers(1, 20)),
                      min_size=1, max_size=10),
)
def test_bulk_decodes_decide_as_the_loop_does(setup, workload):
    with_bulk = _trace(setup, workload)
    original = scheduler_module._leading_decodes
    scheduler_module._leading_decodes = lambda requests, start, limit: 0  # the loop only
    try:
        without = _trace(setup, workload)
    finally:
        scheduler_module._leading_decodes = original
    assert with_bulk == without


def _partial_after_step(s, out) -> int:
    """Running requests with prompt tokens left after this step, counted from scratch."""
    n = 0
    for r in s.running:
        end = r.num_tokens - (1 if r.output_token_ids else 0)
        if r.num_computed_tokens + out.num_scheduled_tokens.get(r.request_id, 0) < end:
            n += 1
    return n


def test_partial_prefills_are_counted_once_in_both_orders():
    for order in ("decode-first", "prefill-first"):
        s = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=16,
                           max_num_partial_prefills=2, scheduling_order=order,
                           num_gpu_blocks=256)
        ex = FakeExecutor()
        s.add_request(req("a", 100, 4))
        out = s.schedule()  # "a" becomes a running partial prefill
        assert out.num_scheduled_tokens == {"a": 16}
        s.update_from_output(out, ex.execute(out))
        for rid in "bcd":
            s.add_request(req(rid, 100, 4))
        out = s.schedule()
        # NOTE: with "a" counted twice (the old prefill-first bug), "b" could not join it.
        assert set(out.num_scheduled_tokens) == {"a", "b"}, order
        assert s._num_partial(s._step) == _partial_after_step(s, out) == 2, order
        s.update_from_output(out, ex.execute(out))
        s.check_invariants()


def test_one_token_prefill_chunks_reach_the_prefix_cache():
    s = make_scheduler(block_size=4, max_num_batched_tokens=4, num_gpu_blocks=64)
    ex = FakeExecutor()
    for rid in "acd":
        s.add_request(req(rid, 2, 60))
    for _ in range(2):
        out = s.schedule()
        s.update_from_output(out, ex.execute(out))
    prompt = list(range(100, 109))
    s.add_request(req("b", 9, 1, prompt=prompt))
    for _ in range(12):  # three decodes leave b one token per step
        out = s.schedule()
        s.update_from_output(out, ex.execute(out))
        s.check_invariants()
        if "b" not in s.requests:
            break
    assert "b" not in s.requests, "b did not finish"
    again = req("e", 9, 1, prompt=prompt)
    assert len(s.kv.get_computed_blocks(again)) == 2  # (9 - 1) // 4 full blocks


def _a_decodes_at_a_block_boundary():
    """prefill-first, 4 blocks of 4 tokens: "a" (4 prompt tokens) ran its prefill and its
    next decode needs a new block."""
    s = make_scheduler(block_size=4, num_gpu_blocks=4, scheduling_order="prefill-first",
                       max_num_batched_tokens=64)
    ex = FakeExecutor()
    s.add_request(req("a", 4, 10))
    out = s.schedule()
    s.update_from_output(out, ex.execute(out))
    return s, ex


def test_prefill_first_gives_back_an_admission_instead_of_preempting_it():
    s, ex = _a_decodes_at_a_block_boundary()
    b = req("b", 12, 1)
    s.add_request(b)  # admitted first (prefill-first), taking the last three blocks
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1}
    assert not out.new_requests and not out.preempted_request_ids
    assert b.status.name == "WAITING" and b.first_scheduled_time is None
    assert b.num_preemptions == 0 and s.stats.num_preemptions == 0
    assert s.stats.prefix_cache_queries == 4  # a's lookup only
    s.update_from_output(out, ex.execute(out))
    s.check_invariants()


def test_a_readmission_given_back_counts_no_recompute_until_it_runs():
    s, ex = _a_decodes_at_a_block_boundary()
    b = req("b", 12, 1)
    s.add_request(b)
    b.num_preemptions, b.status = 1, b.status.PREEMPTED  # as if preempted before
    out = s.schedule()  # b is readmitted, then given back for a's block
    assert out.num_scheduled_tokens == {"a": 1}
    assert b.status.name == "PREEMPTED" and b.num_recomputed_tokens == 0
    assert s.stats.num_recomputed_tokens == 0 and s.stats.recompute_prefix_hits == 0
    s.update_from_output(out, ex.execute(out))
    s.check_invariants()
    while "b" in s.requests:
        out = s.schedule()
        s.update_from_output(out, ex.execute(out))
        s.check_invariants()
    assert b.num_recomputed_tokens == s.stats.num_recomputed_tokens == 11  # counted once


def test_a_waiting_pass_that_fails_loses_no_request():
    # A takes a chunk, B is skipped (one partial prefill at a time), and looking up C's
    # prefix fails: the step is abandoned, and B and C must be waiting again.
    s = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=16,
                       max_num_partial_prefills=1, max_model_len=256)
    ex = FakeExecutor()
    for rid, n in (("A", 40), ("B", 40), ("C", 8)):
        s.add_request(req(rid, n, 2))
    lookup, calls = s.kv.get_computed_blocks, []

    def failing(request):
        calls.append(request.request_id)
        if request.request_id == "C":
            raise RuntimeError("lookup failed")
        return lookup(request)

    s.kv.get_computed_blocks = failing
    try:
        s.schedule()
    except RuntimeError:
        pass
    else:
        raise AssertionError("the injected failure did not reach schedule()")
    assert calls == ["A", "B", "C"]
    s.check_invariants()  # nobody lost: B and C wait, A failed with the step
    assert {r.request_id for r in s.waiting} == {"B", "C"}
    assert s.requests.keys() == {"B", "C"}
    s.kv.get_computed_blocks = lookup
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, ex.execute(out))
        s.check_invariants()
