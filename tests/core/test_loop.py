"""``run_step``: one step of the loop the engine and the simulator share."""

from __future__ import annotations

from helpers import FakeExecutor, make_scheduler, req
from kvloop.core import RequestStatus, run_step


class _Failing:
    def execute(self, out):
        raise RuntimeError("kernel fell over")


def test_a_step_schedules_executes_and_updates():
    s = make_scheduler()
    s.add_request(req("a", 6, 2))
    s.add_request(req("b", 3, 1))
    r = run_step(s, FakeExecutor())
    assert r.error is None and r.failed == []
    assert r.runner_output is not None and r.runner_output.step_time_s == 0.01
    assert set(r.scheduler_output.num_scheduled_tokens) == {"a", "b"}
    assert {t.request_id for t in r.touched} == {"a", "b"}
    assert s.requests["a"].output_token_ids == [7] and "b" not in s.requests  # b is done
    s.check_invariants()


def test_a_failed_step_fails_only_its_requests_and_the_loop_goes_on():
    s = make_scheduler(max_num_seqs=1)
    a, b = req("a", 4, 3), req("b", 4, 3)
    s.add_request(a)
    s.add_request(b)
    r = run_step(s, _Failing())
    assert isinstance(r.error, RuntimeError) and r.runner_output is None
    assert r.failed == [a] and r.touched == [a]
    assert a.status == RequestStatus.FINISHED_ERROR and "kernel fell over" in a.error
    s.check_invariants()
    assert s.kv.num_used_blocks == 0
    while s.has_unfinished_requests():  # b still runs to completion
        assert run_step(s, FakeExecutor()).error is None
        s.check_invariants()
    assert b.output_token_ids == [7, 7, 7]
