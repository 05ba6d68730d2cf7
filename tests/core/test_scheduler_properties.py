"""Property tests: random workloads against tiny pools never break the loop's invariants."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import FakeExecutor, make_scheduler, req, step
from kvloop.core import RequestStatus

_request = st.tuples(
    st.integers(0, 6),  # arrival step
    st.integers(1, 40),  # prompt length
    st.integers(1, 24),  # max tokens
    st.integers(0, 3),  # priority
    st.integers(0, 2),  # shared prefix family (0: none)
    st.one_of(st.none(), st.integers(0, 30)),  # abort at step
)


@st.composite
def _setup(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    chunked = draw(st.booleans())
    max_model_len = 64
    budget = draw(st.integers(8, 80)) if chunked else draw(st.integers(64, 96))
    return dict(
        block_size=block_size,
        num_gpu_blocks=draw(st.integers(64 // block_size, 160 // block_size)),
        num_cpu_blocks=draw(st.integers(0, 40)),
        enable_prefix_caching=draw(st.booleans()),
        max_model_len=max_model_len,
        max_num_batched_tokens=budget,
        max_num_seqs=draw(st.integers(1, 6)),
        enable_chunked_prefill=chunked,
        max_num_partial_prefills=draw(st.integers(1, 3)),
        long_prefill_token_threshold=draw(st.sampled_from([0, 4, 12])),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        preemption_mode=draw(st.sampled_from(["recompute", "swap"])),
        scheduling_order=draw(st.sampled_from(["decode-first", "prefill-first"])),
    )


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=_setup(), requests=st.lists(_request, min_size=1, max_size=12))
def test_random_workloads_drain_without_leaks(setup, requests):
    s = make_scheduler(**setup)
    ex = FakeExecutor()
    pending = sorted(enumerate(requests), key=lambda x: x[1][0])
    made = []
    aborts: dict[int, list[str]] = {}
    n = 0
    while pending or s.has_unfinished_requests():
        while pending and pending[0][1][0] <= n:
            i, (_, plen, mt, prio, fam, abort_at) = pending.pop(0)
            prompt = [fam * 1000 + j for j in range(plen)] if fam else None
            r = req(f"r{i}", plen, mt, priority=prio, arrival=float(n), prompt=prompt)
            s.add_request(r)
            made.append(r)
            if abort_at is not None:
                aborts.setdefault(n + abort_at, []).append(r.request_id)
        for rid in aborts.pop(n, []):
            s.abort_request(rid)
            s.check_invariants()
        if s.has_unfinished_requests():
            out = step(s, ex)
            if s.has_unfinished_requests() and not s.swapped:
                # Progress: a step with waiting or running work schedules something.
                assert out.total_num_scheduled_tokens > 0 or not s.running
        n += 1
        assert n < 2000, "no progress: livelock or deadlock"
    assert s.kv.num_used_blocks == 0 and not s.kv.req_blocks
    assert len(s.kv.cpu_free) == s.kv.num_cpu_blocks
    for r in made:
        assert r.is_finished
        if r.status == RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.max_tokens
        elif r.status == RequestStatus.FINISHED_ERROR:
            assert r.max_total_tokens > 64 or r.error
        else:
            assert r.status == RequestStatus.FINISHED_ABORTED


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
