"""Step records say why: who was admitted, who was left waiting and why, who was preempted
for whom."""

import json

from helpers import make_scheduler, req, run_all, step
from kvloop.core import StepRecord
from kvloop.core.decisions import Cause, Reason, describe_cause, describe_reason


def test_seats_and_budget_stop_the_waiting_pass():
    s = make_scheduler(max_num_seqs=2)
    for rid in "ABC":
        s.add_request(req(rid, 4, 3))
    step(s)
    rec = s.recorder.records[0]
    assert [a[0] for a in rec.admitted] == ["A", "B"]
    assert (rec.held_reason, rec.num_held_behind) == (Reason.SEATS, 1)
    run_all(s)

    s = make_scheduler(max_num_batched_tokens=8, long_prefill_token_threshold=0)
    for rid in "ABC":
        s.add_request(req(rid, 8, 3))
    step(s)
    rec = s.recorder.records[0]
    assert rec.admitted == [["A", 8, 0]]
    assert (rec.held_reason, rec.num_held_behind) == (Reason.BUDGET, 2)
    run_all(s)


def test_no_free_blocks_then_a_preemption_with_its_cause():
    # 6 blocks of 4 tokens: three 8-token prompts fill the pool; the next decode needs a
    # block, so the latest arrival (C) is preempted for A, then waits for blocks.
    s = make_scheduler(num_gpu_blocks=6, max_num_seqs=4, cost_aware_preemption=False,
                       max_num_batched_tokens=64)
    for rid in "ABC":
        s.add_request(req(rid, 8, 8))
    for _ in range(3):
        step(s)
    first, second, third = s.recorder.records
    assert first.kv_blocks_allocated == 6 and first.kv_blocks_used == 6
    assert second.preempted == [("C", "recompute")]
    assert second.preempt_causes == [["C", Cause.BLOCKS, "A"]]
    assert second.held_reason == Reason.STEP_PREEMPTED and second.num_held_behind == 1
    assert second.kv_blocks_freed == 2
    assert third.held == [["C", Reason.BLOCKS]] and third.num_held_behind == 0
    run_all(s)


def test_cost_aware_admission_keeps_headroom():
    s = make_scheduler(num_gpu_blocks=6, max_num_seqs=4)
    for rid in "ABC":
        s.add_request(req(rid, 8, 8))
    step(s)
    assert s.recorder.records[0].held == [["C", Reason.HEADROOM]]
    run_all(s)


def test_decisions_survive_a_json_round_trip():
    s = make_scheduler(num_gpu_blocks=6, max_num_seqs=4, cost_aware_preemption=False)
    for rid in "ABC":
        s.add_request(req(rid, 8, 8))
    run_all(s)
    for rec in s.recorder.records:
        assert StepRecord.from_dict(json.loads(rec.to_json())) == rec


def test_nothing_is_kept_when_no_one_records():
    s = make_scheduler(record=False, max_num_seqs=1)
    for rid in "AB":
        s.add_request(req(rid, 4, 2))
    s.schedule()
    assert s._step is not None and s._step.decisions is None


def test_every_reason_and_cause_has_words():
    assert all(describe_reason(r) != r.value for r in Reason)
    assert describe_cause(Cause.BLOCKS, "A").endswith(" A")
