"""The simulator end to end: the real scheduler, the cost model, a virtual clock."""

import math

from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core import StepRecorder, read_jsonl
from kvloop.executor.simulated import CostModel, get_hardware_spec, get_model_spec
from kvloop.sim.driver import simulate
from kvloop.sim.traces import load_trace
from kvloop.sim.workloads import synthetic_workload


def _cost() -> CostModel:
    return CostModel(get_model_spec("llama-3.1-8b"), get_hardware_spec("h100"))


def _run(workload, recorder=None, **kw):
    cache_kw = {k: kw.pop(k) for k in list(kw) if k in CacheConfig.__dataclass_fields__}
    sched = SchedulerConfig(**({"max_model_len": 4096} | kw))
    cache = CacheConfig(**({"num_gpu_blocks": 2000} | cache_kw))
    return simulate(workload, sched, cache, _cost(), recorder=recorder)


def test_every_request_finishes_at_its_length():
    wl = synthetic_workload(60, request_rate=20.0, prompt_len="16:600", output_len="1:80", seed=3)
    res = _run(wl)
    by_id = {w.request_id: w.output_len for w in wl}
    for r in res.requests:
        assert r.num_output_tokens == by_id[r.request_id]
        assert r.arrival_time <= r.first_scheduled_time <= r.first_token_time <= r.finished_time
    m = res.metrics
    assert m["completed"] == 60
    assert 0 < m["ttft"]["p50"] <= m["e2e"]["p50"]
    assert m["scheduler"]["num_preemptions"] == 0
    assert res.scheduler.kv.num_used_blocks == 0


def test_same_seed_same_records(tmp_path):
    def records(seed):
        wl = synthetic_workload(
            30, request_rate=50.0, prompt_len="8:300", output_len="1:40", seed=seed
        )
        rec = StepRecorder()
        _run(wl, rec, num_gpu_blocks=40, num_cpu_blocks=20, preemption_mode="swap")
        return [r.to_json() for r in rec.records]

    a, b = records(1), records(1)
    assert a == b and records(2) != a


def test_trace_jsonl_round_trip(tmp_path):
    wl = synthetic_workload(20, request_rate=math.inf, prompt_len=100, output_len=10)
    path = tmp_path / "steps.jsonl"
    with open(path, "w") as f:
        rec = StepRecorder(sink=f)
        res = _run(wl, rec, num_gpu_blocks=60)
    loaded = read_jsonl(str(path))
    assert loaded == rec.records
    assert sum(len(r.finished) for r in loaded) == 20
    assert sum(r.step_time_s for r in loaded) > 0
    # The step clock matches the requests' timestamps.
    last = max(r.finished_time for r in res.requests)
    assert math.isclose(loaded[-1].time_s + loaded[-1].step_time_s, last)
    kinds = {e.kind for r in loaded for e in r.scheduled}
    assert {"prefill", "decode"} <= kinds


def test_memory_pressure_preempts_in_both_modes():
    wl = synthetic_workload(40, request_rate=math.inf, prompt_len=200, output_len=200)
    rec = _run(wl, num_gpu_blocks=120).metrics["scheduler"]
    assert rec["num_recompute_preemptions"] > 0 and rec["recomputed_tokens"] > 0
    swap = _run(wl, num_gpu_blocks=120, num_cpu_blocks=400, preemption_mode="swap")
    s = swap.metrics["scheduler"]
    assert s["num_swap_preemptions"] > 0 and s["swapped_in_blocks"] == s["swapped_out_blocks"]
    assert swap.metrics["completed"] == 40


def test_mooncake_prefix_reuse_hits_the_cache():
    wl = load_trace("mooncake", num_requests=300)
    wl = [w for w in wl if len(w.prompt_token_ids) + w.output_len <= 60000]
    # Upper bound: the share of prompt blocks seen before, with an unlimited cache.
    seen, reused, total = set(), 0, 0
    for w in wl:
        p = w.prompt_token_ids
        for h in (p[i] for i in range(0, len(p) - 511, 512)):  # a block's first token names it
            reused += h in seen
            total += 1
            seen.add(h)
    ideal = reused / total
    on = _run(wl, max_model_len=65536, num_gpu_blocks=200000).metrics["scheduler"]
    assert 0.5 * ideal < on["prefix_cache_hit_rate"] <= ideal
    off = _run(wl, max_model_len=65536, num_gpu_blocks=20000, enable_prefix_caching=False)
    assert off.metrics["scheduler"]["prefix_cache_hits"] == 0
