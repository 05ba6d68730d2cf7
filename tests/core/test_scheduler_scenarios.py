"""The textbook pictures of continuous batching, step by step."""

from helpers import FakeExecutor, make_scheduler, req, run_all, step
from kvloop.core import RequestStatus


def test_textbook_continuous_batching():
    # A, B, C run; C finishes after step 1; D joins in step 2; by step 3 only A and D run.
    s = make_scheduler(max_num_seqs=3)
    s.add_request(req("A", 4, 10))
    s.add_request(req("B", 4, 3))
    s.add_request(req("C", 4, 1))
    s.add_request(req("D", 4, 10))
    out0 = step(s)
    assert set(out0.num_scheduled_tokens) == {"A", "B", "C"}
    assert "C" not in s.requests  # finished after its first token
    out1 = step(s)
    assert set(out1.num_scheduled_tokens) == {"A", "B", "D"}
    assert out1.num_scheduled_tokens["D"] == 4 and out1.num_scheduled_tokens["A"] == 1
    step(s)  # B's third token: B finishes
    out3 = step(s)
    assert set(out3.num_scheduled_tokens) == {"A", "D"}
    run_all(s)


def test_long_prompt_chunked_while_decodes_continue():
    s = make_scheduler(max_num_batched_tokens=16, max_model_len=256)
    s.add_request(req("short", 4, 20))
    step(s)  # short's prefill
    s.add_request(req("long", 60, 2))
    chunks = []
    while "long" in s.requests and s.requests["long"].num_output_tokens == 0:
        out = step(s)
        assert out.num_scheduled_tokens["short"] == 1  # the decode never waits
        chunks.append(out.num_scheduled_tokens.get("long", 0))
    assert chunks == [15, 15, 15, 15]
    rec = s.recorder.records[1]
    kinds = {e.request_id: e.kind for e in rec.scheduled}
    assert kinds == {"short": "decode", "long": "prefill"}
    run_all(s)


def test_partial_prefill_limit_lets_short_prompts_through():
    # NOTE: a pool that holds the three long prompts whole; cost-aware admission would not
    # start a second one that cannot finish beside the first.
    s = make_scheduler(
        num_gpu_blocks=160,
        max_num_batched_tokens=40,
        max_model_len=512,
        max_num_partial_prefills=2,
        long_prefill_token_threshold=16,
    )
    s.add_request(req("long1", 200, 1))
    s.add_request(req("long2", 200, 1))
    s.add_request(req("long3", 200, 1))
    short = req("short", 8, 1)
    s.add_request(short)
    out = step(s)
    # long3 must wait (2 partial prefills in flight) but the short prompt behind it fits
    # whole: all 8 tokens in this one step, so it samples its token and is done.
    assert out.num_scheduled_tokens == {"long1": 16, "long2": 16, "short": 8}
    kinds = {e.request_id: e.kind for e in s.recorder.records[-1].scheduled}
    assert kinds == {"long1": "prefill", "long2": "prefill", "short": "prefill"}
    assert short.status == RequestStatus.FINISHED_LENGTH and short.num_output_tokens == 1
    out = step(s)
    # 8 tokens of budget are left, but long3 still waits: it could not finish its prefill.
    assert out.num_scheduled_tokens == {"long1": 16, "long2": 16}
    run_all(s)


def test_long_prompts_wait_while_a_short_one_is_admitted():
    s = make_scheduler(
        max_num_batched_tokens=32, max_model_len=512, long_prefill_token_threshold=16
    )
    s.add_request(req("long1", 100, 1))
    s.add_request(req("long2", 100, 1))
    s.add_request(req("short", 8, 1))
    out = step(s)
    # One partial prefill at a time: long2 is skipped, but the short prompt fits whole.
    assert out.num_scheduled_tokens == {"long1": 16, "short": 8}
    assert len(s.waiting) == 1
    run_all(s)


def test_recompute_preemption_under_tiny_pool():
    s = make_scheduler(num_gpu_blocks=8, block_size=4, max_model_len=64)
    for r in "ABC":
        s.add_request(req(r, 4, 10))
    run_all(s)
    assert s.stats.num_recompute_preemptions > 0
    assert s.stats.finished_by_reason == {"length": 3}


def test_swap_preemption_and_fallback():
    s = make_scheduler(
        num_gpu_blocks=8, num_cpu_blocks=16, block_size=4, max_model_len=64, preemption_mode="swap"
    )
    for r in "ABC":
        s.add_request(req(r, 4, 10))
    run_all(s)
    assert s.stats.num_swap_preemptions > 0
    assert s.stats.num_blocks_swapped_in == s.stats.num_blocks_swapped_out
    # Host tier too small for anything: swap falls back to recompute.
    s = make_scheduler(
        num_gpu_blocks=8, num_cpu_blocks=1, block_size=4, max_model_len=64, preemption_mode="swap"
    )
    for r in "ABC":
        s.add_request(req(r, 4, 10))
    run_all(s)
    assert s.stats.num_swap_preemptions == 0 and s.stats.num_recompute_preemptions > 0


def test_priority_preemption_of_less_urgent_running():
    s = make_scheduler(num_gpu_blocks=6, block_size=4, max_model_len=64, policy="priority")
    s.add_request(req("low", 15, 8, priority=5))
    step(s)
    step(s)
    s.add_request(req("high", 8, 4, priority=0, arrival=1.0))
    out = step(s)
    assert "high" in out.num_scheduled_tokens
    assert out.preempted_request_ids == ["low"]
    assert s.requests["low"].status == RequestStatus.PREEMPTED
    run_all(s)


def test_fcfs_never_preempts_for_waiting():
    s = make_scheduler(num_gpu_blocks=6, block_size=4, max_model_len=64)
    s.add_request(req("first", 15, 8, priority=5))
    step(s)
    step(s)
    s.add_request(req("second", 8, 4, priority=0))
    out = step(s)
    assert out.preempted_request_ids == [] and "second" not in out.num_scheduled_tokens
    run_all(s)


def test_prefix_hits():
    s = make_scheduler(block_size=4)
    shared = list(range(100, 116))
    s.add_request(req("a", 0, 2, prompt=[*shared, 1, 2]))
    run_all(s)
    s.add_request(req("b", 0, 2, prompt=[*shared, 3, 4, 5]))
    out = step(s)
    assert out.new_requests[0].num_computed_tokens == 16
    assert out.num_scheduled_tokens["b"] == 3
    assert s.stats.prefix_cache_hits == 16 and s.stats.prefix_cache_queries == 18 + 19
    # A different salt sees nothing.
    s.add_request(req("c", 0, 2, prompt=[*shared, 3], salt="tenant-2"))
    out = step(s)
    assert out.new_requests[0].num_computed_tokens == 0
    run_all(s)


def test_full_prompt_hit_still_computes_last_token():
    s = make_scheduler(block_size=4)
    p = list(range(8))
    s.add_request(req("a", 0, 3, prompt=p))
    run_all(s)
    s.add_request(req("b", 0, 3, prompt=p))
    out = step(s)
    assert out.new_requests[0].num_computed_tokens == 4
    assert out.num_scheduled_tokens["b"] == 4
    run_all(s)


def test_impossible_requests_fail_at_once():
    s = make_scheduler(num_gpu_blocks=4, block_size=4, max_model_len=64)
    too_big = req("big", 10, 10)  # 20 tokens need 5 blocks > 4
    s.add_request(too_big)
    assert too_big.status == RequestStatus.FINISHED_ERROR and "KV blocks" in too_big.error
    too_long = req("long", 60, 10)
    s.add_request(too_long)
    assert "max_model_len" in too_long.error
    assert not s.has_unfinished_requests()


def test_abort_in_every_state():
    s = make_scheduler(
        num_gpu_blocks=8,
        num_cpu_blocks=8,
        block_size=4,
        max_model_len=64,
        preemption_mode="swap",
        max_num_seqs=3,
        cost_aware_preemption=False,  # admit into the last blocks, so a swap must come
    )
    for r in "ABCD":
        s.add_request(req(r, 4, 12))
    while not s.swapped:
        step(s)
    states = {r.request_id: r.status for r in s.requests.values()}
    assert set(states.values()) == {
        RequestStatus.RUNNING,
        RequestStatus.SWAPPED,
        RequestStatus.WAITING,
    }
    for rid in list(states):
        assert s.abort_request(rid)
        s.check_invariants()
    assert not s.abort_request("A")
    assert s.kv.num_used_blocks == 0 and len(s.kv.cpu_free) == 8
    out = s.schedule()
    assert set(out.finished_request_ids) == set(states)


def test_stop_token_and_eos():
    s = make_scheduler()
    r = req("a", 4, 10)
    r.sampling_params.ignore_eos = False
    r.eos_token_ids = frozenset({2})
    s.add_request(r)
    ex = FakeExecutor()
    step(s, ex)
    ex.stop_now.add("a")
    step(s, ex)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [7, 2]


def test_abandoned_step_fails_only_its_requests():
    s = make_scheduler(max_num_seqs=2)
    for r in "ABC":
        s.add_request(req(r, 4, 5))
    out = s.schedule()
    failed = s.abandon_step(out, "boom")
    assert {r.request_id for r in failed} == {"A", "B"}
    assert all(r.status == RequestStatus.FINISHED_ERROR and r.error == "boom" for r in failed)
    s.check_invariants()
    assert s.kv.num_used_blocks == 0
    run_all(s)
