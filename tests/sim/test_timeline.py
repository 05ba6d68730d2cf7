"""Summarising the simulator's requests per step (``StepTimeline``) gives the figures that
reading every token gives: inter-token latencies exactly, QoE to rounding."""

from __future__ import annotations

import random

import pytest

from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.executor.simulated import CostModel, ModelSpec, engine_overhead, get_hardware_spec
from kvloop.sim.cluster import simulate_cluster
from kvloop.sim.driver import simulate, timelines
from kvloop.sim.metrics import summarize_requests
from kvloop.sim.published_metrics import qoe
from kvloop.sim.timeline import StepTimeline
from kvloop.sim.workloads import apply_tenant_mix, synthetic_workload

LLAMA2_7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
             "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32000,
             "torch_dtype": "float16"}


def _cost() -> CostModel:
    return CostModel(ModelSpec.from_hf_config(LLAMA2_7B, "m"), get_hardware_spec("h100"),
                     overhead=engine_overhead("vllm"))


def test_runs_cut_token_times_at_skipped_steps():
    line = StepTimeline([1.0, 2.0, 4.0, 7.0, 11.0, 16.0, 22.0])
    assert line.runs([2.0, 4.0, 7.0]) == [(1, 3)]
    assert line.runs([1.0, 4.0, 7.0, 16.0, 22.0]) == [(0, 1), (2, 2), (5, 2)]
    assert line.runs([22.0]) == [(6, 1)]
    assert line.runs([3.0, 4.0]) is None  # not a step end
    runs = line.runs([1.0, 4.0, 7.0, 16.0, 22.0])
    assert line.jumps(runs) == [3.0, 9.0]
    assert line.pieces(runs) == [(1, 0.0), (2, 3.0), (2, 6.0)]
    assert line.gap_counts([(0, 3), (1, 2), (5, 2)]) == [(1.0, 1), (2.0, 2), (6.0, 1)]
    assert StepTimeline([1.0, 1.0, 2.0]).runs([1.0, 2.0]) is None  # ambiguous: not used


def test_qoe_by_pieces_is_the_token_by_token_sum():
    rng = random.Random(0)
    checked = 0
    for _ in range(300):
        times, t, pieces = [], rng.uniform(0, 5), []
        for _ in range(rng.randint(1, 4)):
            t += rng.uniform(0, 3)  # a stall between pieces
            count, longest = rng.randint(1, 60), 0.0
            for k in range(count):
                gap = rng.uniform(0.001, 0.25) if k else 0.0
                longest = max(longest, gap)
                t += gap
                times.append(t)
            pieces.append((count, longest))
        arrival, ttft, tds = 0.0, rng.uniform(0.1, 3), rng.choice([4.0, 5.0, 20.0])
        want = qoe(times, arrival, ttft, tds)
        assert qoe(times, arrival, ttft, tds, pieces) == pytest.approx(want, abs=1e-12)
        checked += any(g <= 1 / tds for _, g in pieces)
    assert checked > 100  # the closed form ran


def _same_summary(by_step: dict, by_token: dict) -> None:
    assert by_step["itl"]["count"] == by_token["itl"]["count"] > 0
    for q in ("p50", "p90", "p99"):
        assert by_step["itl"][q] == by_token["itl"][q]
    assert by_step["itl"]["mean"] == pytest.approx(by_token["itl"]["mean"], rel=1e-12)
    for key in ("mean", "p10"):
        assert by_step["qoe"][key] == pytest.approx(by_token["qoe"][key], rel=1e-12)
    rest = {k for k in by_token if k not in {"itl", "qoe", "wall_time_s"}}
    assert {k: by_step[k] for k in rest} == {k: by_token[k] for k in rest}


@pytest.mark.parametrize("sched, blocks, fast", [
    ({"max_model_len": 4096, "cost_aware_preemption": False}, 400, True),  # recompute
    ({"max_model_len": 4096, "preemption_mode": "swap"}, 400, True),
    ({"max_model_len": 4096, "max_num_batched_tokens": 512, "policy": "slo",
      "slo_ttft": 0.5, "slo_tpot": 0.05}, 900, False),
    ({"max_model_len": 4096, "policy": "fair"}, 800, True),
])
def test_a_run_summarised_per_step_matches_per_token(sched, blocks, fast):
    work = synthetic_workload(300, request_rate=40.0, prompt_len="16:1500",
                              output_len="1:300", seed=1)
    if sched.get("policy") == "fair":
        apply_tenant_mix(work, [3.0, 1.0], seed=1)
    result = simulate(work, SchedulerConfig(**sched),
                      CacheConfig(num_gpu_blocks=blocks, num_cpu_blocks=600), _cost(),
                      fast_forward=fast)
    lines = timelines(result.replicas)
    split = [line.runs(r.token_times) for r in result.requests
             if len(r.token_times) > 1 for line in [lines[r.request_id]]]
    assert all(runs is not None for runs in split)
    if "policy" not in sched:  # preempted requests' tokens skip steps
        assert sum(len(runs) > 1 for runs in split) >= 2
    kwargs = {"slo_ttft": sched.get("slo_ttft"), "slo_tpot": sched.get("slo_tpot")}
    _same_summary(result.metrics, summarize_requests(result.requests, **kwargs))


def test_a_cluster_run_summarised_per_step_matches_per_token():
    work = synthetic_workload(200, request_rate=60.0, prompt_len="16:1000",
                              output_len="1:200", seed=2)
    result = simulate_cluster(work, SchedulerConfig(max_model_len=4096),
                              CacheConfig(num_gpu_blocks=600), _cost(), num_replicas=3)
    _same_summary(result.metrics, summarize_requests(result.requests))
