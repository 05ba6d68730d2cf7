"""Property tests: random workloads against tiny pools never break the loop's invariants."""

import os
import subprocess
import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import FakeClock, FakeExecutor, make_scheduler, req, step
from kvloop.core import RequestStatus

_request = st.tuples(
    st.integers(0, 6),  # arrival step
    st.integers(1, 48),  # prompt length (prompt + max tokens may exceed max_model_len)
    st.integers(1, 24),  # max tokens
    st.integers(0, 3),  # priority
    st.integers(0, 2),  # shared prefix family (0: none)
    st.one_of(st.none(), st.integers(0, 30)),  # abort at step
    st.integers(0, 2),  # tenant
    st.one_of(st.none(), st.sampled_from([0.02, 0.1, 0.5])),  # own TTFT target
)


@st.composite
def _setup(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    chunked = draw(st.booleans())
    max_model_len = 64
    budget = draw(st.integers(8, 80)) if chunked else draw(st.integers(64, 96))
    return dict(
        block_size=block_size,
        num_gpu_blocks=draw(st.integers(32 // block_size, 160 // block_size)),
        num_cpu_blocks=draw(st.integers(0, 40)),
        enable_prefix_caching=draw(st.booleans()),
        max_model_len=max_model_len,
        max_num_batched_tokens=budget,
        max_num_seqs=draw(st.integers(1, 6)),
        enable_chunked_prefill=chunked,
        max_num_partial_prefills=draw(st.integers(1, 3)),
        long_prefill_token_threshold=draw(st.sampled_from([0, 4, 12])),
        policy=(policy := draw(st.sampled_from(["fcfs", "priority", "slo", "fair"]))),
        slo_ttft=draw(st.sampled_from([0.03, 0.2, 1.0])) if policy == "slo" else None,
        slo_tpot=draw(st.sampled_from([None, 0.01, 0.05])),
        slo_overload=draw(st.sampled_from(["defer", "reject"])),
        aging_s=draw(st.sampled_from([0.0, 0.05, 1.0])) if policy != "slo" else 0.5,
        tenant_weights=draw(st.sampled_from([(), (("t1", 3.0),)])),
        cost_aware_preemption=draw(st.booleans()),
        max_preemptions=draw(st.integers(1, 3)),
        preemption_mode=draw(st.sampled_from(["recompute", "swap"])),
        scheduling_order=draw(st.sampled_from(["decode-first", "prefill-first"])),
    )


def _refusal(setup: dict, num_tokens: int) -> str | None:
    """Why a request of ``num_tokens`` (prompt + max_tokens) must be refused on arrival, as
    the text its error names; None when it can run."""
    if num_tokens > setup["max_model_len"]:
        return "max_model_len"
    if -(-num_tokens // setup["block_size"]) > setup["num_gpu_blocks"]:
        return "KV blocks"
    return None


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=_setup(), requests=st.lists(_request, min_size=1, max_size=12))
def test_random_workloads_drain_without_leaks(setup, requests):
    clock = FakeClock()
    s = make_scheduler(clock=clock, **setup)
    ex = FakeExecutor()
    pending = sorted(enumerate(requests), key=lambda x: x[1][0])
    made = []
    refusals: dict[str, str | None] = {}
    aborts: dict[int, list[str]] = {}
    aborted: set[str] = set()
    idle_before = False
    n = 0
    while pending or s.has_unfinished_requests():
        while pending and pending[0][1][0] <= n:
            i, (_, plen, mt, prio, fam, abort_at, tenant, ttft) = pending.pop(0)
            prompt = [fam * 1000 + j for j in range(plen)] if fam else None
            r = req(f"r{i}", plen, mt, priority=prio, arrival=clock.now, prompt=prompt,
                    tenant=f"t{tenant}", slo_ttft=ttft)
            s.add_request(r)
            made.append(r)
            refusal = refusals[r.request_id] = _refusal(setup, plen + mt)
            if refusal is None:
                assert r.status == RequestStatus.WAITING and r.request_id in s.requests
            else:  # refused on arrival, never queued
                assert r.status == RequestStatus.FINISHED_ERROR and refusal in r.error
                assert r.request_id not in s.requests
            if abort_at is not None:
                aborts.setdefault(n + abort_at, []).append(r.request_id)
        for rid in aborts.pop(n, []):
            if s.abort_request(rid):  # False: refused or finished already
                aborted.add(rid)
            s.check_invariants()
        if s.has_unfinished_requests():
            only_swapped = bool(s.swapped) and not s.running
            out = step(s, ex, clock)
            # Progress, swapped requests included: a step with unfinished work schedules
            # tokens unless it preempted (which frees room for the next step) or rejected
            # requests, so no two steps in a row are idle; and swapped work with nothing
            # running swaps in at once.
            rejected = any(r.status == RequestStatus.FINISHED_REJECTED for r in made
                           if r.request_id in out.finished_request_ids)
            idle = out.total_num_scheduled_tokens == 0 and not rejected
            if idle:
                assert out.preempted_request_ids, f"step {n} had work but did nothing"
                assert not idle_before, f"steps {n - 1} and {n} both scheduled nothing"
            if only_swapped:
                assert out.blocks_to_swap_in, f"step {n}: nothing runs, yet nothing swapped in"
            idle_before = idle
        else:
            idle_before = False
        n += 1
        assert n < 2000, "no progress: livelock or deadlock"
    assert s.kv.num_used_blocks == 0 and not s.kv.req_blocks
    assert len(s.kv.cpu_free) == s.kv.num_cpu_blocks
    for r in made:
        rid = r.request_id
        if refusals[rid] is not None:
            assert r.status == RequestStatus.FINISHED_ERROR and refusals[rid] in r.error, rid
            assert r.num_output_tokens == 0
        elif rid in aborted:
            assert r.status == RequestStatus.FINISHED_ABORTED, rid
        elif r.status == RequestStatus.FINISHED_REJECTED:  # only by slo, only before it ran
            assert setup["policy"] == "slo" and setup["slo_overload"] == "reject", rid
            assert r.num_output_tokens == 0 and "TTFT" in r.error
        else:  # ignore_eos and the fake executor never samples a stop token
            assert r.status == RequestStatus.FINISHED_LENGTH, (rid, r.status, r.error)
            assert r.num_output_tokens == r.max_tokens and r.error is None


def test_same_seed_same_step_records():
    def run():
        s = make_scheduler(
            num_gpu_blocks=10,
            block_size=4,
            num_cpu_blocks=6,
            preemption_mode="swap",
            max_num_batched_tokens=12,
        )
        for i in range(8):
            s.add_request(req(f"r{i}", 3 + 5 * i % 17, 4 + i % 5, arrival=float(i)))
        while s.has_unfinished_requests():
            step(s)
        return [r.to_json() for r in s.recorder.records]

    assert run() == run()


def test_prompts_are_the_same_in_every_process():
    # Prompts must not come from hash(str), which PYTHONHASHSEED changes per process.
    code = "from helpers import req; print(req('r0', 6, 1).prompt_token_ids)"
    tests_dir = Path(__file__).resolve().parents[1]
    seen = {
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=tests_dir,
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert seen == {f"{req('r0', 6, 1).prompt_token_ids}\n"}
