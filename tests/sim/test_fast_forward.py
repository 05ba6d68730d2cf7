"""Fast-forward (``Scheduler.fast_forward_decodes``) changes nothing but the speed.

Each workload is simulated twice, stepping one step at a time and fast-forwarding, and
everything the runs leave behind must be equal, floats exactly (the step times are summed
in the same order): every request's timestamps (first scheduled, first token, each
token, finish), tokens, progress, preemptions and block hashes; the scheduler's stats and
step count; the KV pool (free-queue order, each block's owners and hash, the prefix-cache
map in its insertion order, evictions, host blocks); the policy's state; the clock, busy
time and metrics; and the load each replica showed to the router at every arrival. The
scheduler's invariants are checked after every fast-forwarded run of steps, and each
workload asserts that fast-forward did run most of its steps (or, where it must not run,
that it did not).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import pytest

from kvloop.cluster.routers import make_router
from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core import Request, Scheduler, StepRecorder
from kvloop.executor.simulated import (
    CostModel,
    ModelSpec,
    engine_overhead,
    get_hardware_spec,
    num_gpu_blocks,
)
from kvloop.sampling_params import SamplingParams
from kvloop.sim.cluster import _Routing, replica_names
from kvloop.sim.driver import Replica, run_replicas, simulate, to_requests
from kvloop.sim.inference_perf import workload_from_config
from kvloop.sim.measured import MeasuredSteps
from kvloop.sim.traces import WorkloadRequest
from kvloop.sim.workloads import apply_priority_mix, apply_tenant_mix, synthetic_workload

LLAMA2_7B = {  # meta-llama/Llama-2-7b-hf config.json (the fields read)
    "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32000,
    "torch_dtype": "float16",
}
CODELLAMA_34B = {  # codellama/CodeLlama-34b-hf config.json
    "hidden_size": 8192, "intermediate_size": 22016, "num_attention_heads": 64,
    "num_hidden_layers": 48, "num_key_value_heads": 8, "vocab_size": 32000,
    "torch_dtype": "bfloat16",
}
MIXTRAL = {  # mistralai/Mixtral-8x7B-v0.1 config.json
    "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "vocab_size": 32000, "torch_dtype": "bfloat16",
}
H100 = get_hardware_spec("h100")
VLLM = engine_overhead("vllm")  # async scheduling, CUDA graphs, frontend time


def _model(cfg: dict, name: str) -> ModelSpec:
    return ModelSpec.from_hf_config(cfg, name)


def _cost(cfg: dict = LLAMA2_7B, tp: int = 1, overhead: bool = True) -> CostModel:
    return CostModel(_model(cfg, "m"), H100, tp=tp, overhead=VLLM if overhead else None)


def _inference_perf(*, groups: int, per_group: int, system: int, question: int,
                    output: int, stages: list[tuple[float, float]],
                    load: str = "constant") -> list[WorkloadRequest]:
    """A development-set shared-prefix workload (``sim_validate_vllm``'s shape), scaled."""
    config = {
        "data": {"type": "shared_prefix", "shared_prefix": {
            "num_unique_system_prompts": groups, "num_users_per_system_prompt": per_group,
            "system_prompt_len": system, "question_len": question, "output_len": output}},
        "load": {"type": load, "stages": [{"rate": r, "duration": d} for r, d in stages]},
    }
    return workload_from_config(config).requests


def _random(n: int, rate: float, prompt: str, output: str, seed: int = 0,
            burstiness: float = 1.0) -> list[WorkloadRequest]:
    return synthetic_workload(n, request_rate=rate, prompt_len=prompt, output_len=output,
                              seed=seed, burstiness=burstiness)


@dataclass
class Case:
    """One workload and engine; ``min_share``: the least share of steps fast-forwarded."""

    workload: Callable[[], list[WorkloadRequest]]
    sched: dict[str, Any] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)
    cost: Callable[[], Any] = _cost
    min_share: float = 0.5
    expect: tuple[str, ...] = ()
    """Scheduler totals that must be > 0 (the workload exercises them)."""


def _general() -> list[WorkloadRequest]:
    return _inference_perf(groups=9, per_group=5, system=100, question=475, output=248,
                           stages=[(8, 12), (20, 10)])


def _reasoning() -> list[WorkloadRequest]:
    return _inference_perf(groups=23, per_group=1, system=100, question=980, output=500,
                           stages=[(4, 40)])


def _codegen() -> list[WorkloadRequest]:
    return _inference_perf(groups=11, per_group=4, system=100, question=490, output=247,
                           stages=[(5, 15), (10, 15)])


def _roleplay_poisson() -> list[WorkloadRequest]:
    return _inference_perf(groups=10, per_group=5, system=150, question=635, output=251,
                           stages=[(6, 40)], load="poisson")


def _long_shared_prompts() -> list[WorkloadRequest]:
    """Prompts longer than a step's budget that fit in one chunk thanks to their cached
    system prompt: while they wait, evictions may take their hits away."""
    return _inference_perf(groups=4, per_group=10, system=1600, question=500, output=150,
                           stages=[(12, 25)])


def _prompt_extends_outputs() -> list[WorkloadRequest]:
    """Prompts that extend two long requests' prompts with the placeholder outputs those
    generate: a waiting one's next block can become cached while it waits."""
    bases = [list(range(10_000 * (i + 1), 10_000 * (i + 1) + 64)) for i in range(2)]
    out = [WorkloadRequest(f"a{i}", 0.0, base, 1500) for i, base in enumerate(bases)]
    for i in range(40):
        zeros, tail = [0] * 16 * (10 + 2 * i), range(1_000_000 + 50 * i, 1_000_000 + 50 * i + 40)
        out.append(WorkloadRequest(f"b{i}", 0.3 + 0.15 * i, [*bases[i % 2], *zeros, *tail], 30))
    return out


def _with_priorities() -> list[WorkloadRequest]:
    wl = _random(250, 30.0, "16:900", "1:200", seed=4)
    apply_priority_mix(wl, {0: 0.3, 1: 0.7}, seed=4)
    return wl


def _with_tenants() -> list[WorkloadRequest]:
    wl = _random(250, 25.0, "16:900", "1:200", seed=5)
    apply_tenant_mix(wl, [0.6, 0.3, 0.1], seed=5)
    return wl


_DEV = {"max_num_batched_tokens": 2048, "max_num_seqs": 128, "max_model_len": 4096}
_LLAMA2_BLOCKS = num_gpu_blocks(_model(LLAMA2_7B, "m"), H100, block_size=16)

CASES: dict[str, Case] = {
    # the development set's shapes, scaled down: roomy pools, prefix hits, async scheduling
    "dev-general": Case(_general, _DEV, {"num_gpu_blocks": _LLAMA2_BLOCKS},
                        expect=("prefix_cache_hits",), min_share=0.8),
    "dev-codegen-tp2": Case(_codegen, _DEV, {"num_gpu_blocks": 6000},
                            cost=lambda: _cost(CODELLAMA_34B, tp=2), min_share=0.8),
    "dev-roleplay-moe-tp2-poisson": Case(_roleplay_poisson, _DEV, {"num_gpu_blocks": 8000},
                                         cost=lambda: _cost(MIXTRAL, tp=2), min_share=0.8),
    # overloaded: a queue that waits on blocks, preemption by recompute
    "dev-reasoning-overloaded": Case(_reasoning, _DEV, {"num_gpu_blocks": 900},
                                     expect=("num_recompute_preemptions",), min_share=0.5),
    "seat-limited": Case(_reasoning, {**_DEV, "max_num_seqs": 8}, {"num_gpu_blocks": 20000},
                         min_share=0.8),
    "long-heads-no-chunking": Case(
        lambda: _random(300, 60.0, "500:820", "100:200", seed=14),
        {"max_model_len": 1024, "max_num_batched_tokens": 1024,
         "enable_chunked_prefill": False}, {"num_gpu_blocks": 2500}, min_share=0.5),
    "long-cached-heads-tight": Case(_long_shared_prompts, _DEV, {"num_gpu_blocks": 700},
                                    expect=("prefix_cache_hits",), min_share=0.3),
    "prompts-extend-outputs": Case(_prompt_extends_outputs, {"max_model_len": 4096},
                                   {"num_gpu_blocks": 140}, expect=("prefix_cache_hits",),
                                   min_share=0.5),
    "tight-recompute-vllm-rules": Case(
        lambda: _random(300, 40.0, "16:1500", "1:300", seed=1),
        {"max_model_len": 4096, "cost_aware_preemption": False}, {"num_gpu_blocks": 400},
        expect=("num_recompute_preemptions",), min_share=0.3),
    "tight-swap": Case(
        lambda: _random(300, 40.0, "16:1500", "1:300", seed=2),
        {"max_model_len": 4096, "preemption_mode": "swap"},
        {"num_gpu_blocks": 400, "num_cpu_blocks": 600},
        expect=("num_swap_preemptions",), min_share=0.2),
    "no-chunked-prefill": Case(
        lambda: _random(250, 30.0, "16:3000", "1:200", seed=3),
        {"max_model_len": 4096, "max_num_batched_tokens": 4096,
         "enable_chunked_prefill": False},
        {"num_gpu_blocks": 1200}, min_share=0.5),
    "chunk-caps-prefill-first": Case(
        lambda: _random(250, 30.0, "16:3000", "1:200", seed=6),
        {"max_model_len": 4096, "max_num_batched_tokens": 512, "max_num_partial_prefills": 2,
         "scheduling_order": "prefill-first"},
        {"num_gpu_blocks": 900}, min_share=0.3),
    "no-prefix-caching": Case(_general, _DEV,
                              {"num_gpu_blocks": 3000, "enable_prefix_caching": False},
                              min_share=0.8),
    "block-size-1": Case(lambda: _random(120, 20.0, "1:200", "1:120", seed=7),
                         {"max_model_len": 1024},
                         {"num_gpu_blocks": 20000, "block_size": 1}, min_share=0.5),
    "no-engine-overhead": Case(lambda: _random(300, 25.0, "16:1200", "1:250", seed=8),
                               {"max_model_len": 4096}, {"num_gpu_blocks": 2500},
                               cost=lambda: _cost(overhead=False), min_share=0.5),
    "priority-tight": Case(_with_priorities,
                           {"max_model_len": 4096, "policy": "priority", "aging_s": 5.0},
                           {"num_gpu_blocks": 500},
                           expect=("num_recompute_preemptions",), min_share=0.2),
    "fair": Case(_with_tenants, {"max_model_len": 4096, "policy": "fair"},
                 {"num_gpu_blocks": 800}, min_share=0.0),
    "slo": Case(lambda: _random(250, 30.0, "16:900", "1:200", seed=9),
                {"max_model_len": 4096, "policy": "slo", "slo_ttft": 0.5, "slo_tpot": 0.05},
                {"num_gpu_blocks": 800}, min_share=0.0),
    "sjf": Case(lambda: _random(250, 30.0, "16:900", "1:200", seed=10),
                {"max_model_len": 4096, "policy": "sjf", "aging_s": 2.0},
                {"num_gpu_blocks": 800}, min_share=0.0),
    "mlfq": Case(lambda: _random(250, 30.0, "16:900", "1:200", seed=11),
                 {"max_model_len": 4096, "policy": "mlfq", "aging_s": 2.0},
                 {"num_gpu_blocks": 800}, min_share=0.0),
}


# -- what a run leaves behind ------------------------------------------------------------
def _request_state(r: Request) -> tuple:
    return (r.request_id, r.status, r.arrival_time, r.first_scheduled_time, r.first_token_time,
            r.finished_time, list(r.token_times), list(r.output_token_ids),
            r.num_computed_tokens, r.num_preemptions, r.num_recomputed_tokens,
            r.num_served_tokens, list(r.block_hashes), r.error)


def _scheduler_state(s: Scheduler) -> dict[str, Any]:
    pool = s.kv.pool
    policy = {k: v for k, v in vars(s.policy).items()
              if k not in ("config", "clock", "waiting", "token_cap", "reject", "on_step",
                           "times", "predictor")}
    predictor = getattr(s.policy, "predictor", None)
    if predictor is not None:
        policy["predictor"] = vars(predictor)
    times = getattr(s.policy, "times", None)
    return {
        "stats": asdict(s.stats),
        "step_index": s.step_index,
        "queues": (len(s.running), len(s.waiting), len(s.swapped), len(s.requests)),
        "free_queue": [b.block_id for b in pool.free_queue],
        "blocks": [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
        "cached": [(h, b.block_id) for h, b in pool.cached.items()],
        "evictions": pool.num_evictions,
        "cpu_free": list(s.kv.cpu_free),
        "policy": policy,
        "step_times": vars(times) if times is not None else None,
    }


def _run(requests: list[Request], replicas: list[Replica],
         route: Callable[[Request], int]) -> tuple[list, list]:
    """Run to completion; the load of every replica at each arrival, as routed."""
    loads = []

    def traced(request: Request) -> int:
        loads.append((request.request_id, [rep.load() for rep in replicas]))
        return route(request)

    run_replicas(requests, replicas, traced)
    return loads, [(rep.clock.now, rep.executor.busy_s, _scheduler_state(rep.scheduler))
                   for rep in replicas]


class _Counted:
    """Counts the steps fast-forward runs and checks the invariants after each run."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps = 0
        inner = Scheduler.fast_forward_decodes

        def counted(sched: Scheduler, *args: Any, **kwargs: Any) -> int:
            steps = inner(sched, *args, **kwargs)
            self.steps += steps
            sched.check_invariants()
            return steps

        monkeypatch.setattr(Scheduler, "fast_forward_decodes", counted)


def _both(make: Callable[[bool], tuple[list[Request], list[Replica], Callable]],
          monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, int, list[Replica]]:
    counted = _Counted(monkeypatch)
    reqs, reps, route = make(False)
    stepped = (_run(reqs, reps, route), [_request_state(r) for r in reqs])
    assert counted.steps == 0
    reqs, reps, route = make(True)
    fast = (_run(reqs, reps, route), [_request_state(r) for r in reqs])
    return stepped, fast, counted.steps, reps


def _assert_same(stepped: Any, fast: Any) -> None:
    (loads_a, reps_a), reqs_a = stepped
    (loads_b, reps_b), reqs_b = fast
    for a, b in zip(reqs_a, reqs_b, strict=True):
        assert a == b, f"request {a[0]} differs"
    for a, b in zip(reps_a, reps_b, strict=True):
        for key in a[2]:
            assert a[2][key] == b[2][key], f"scheduler {key} differs"
        assert a[:2] == b[:2], "clock or busy time differs"
    assert loads_a == loads_b, "a replica showed another load to the router"


# -- the tests -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_fast_forward_leaves_what_stepping_leaves(name: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    case = CASES[name]
    workload = case.workload()
    sched = SchedulerConfig(**case.sched)
    cache = CacheConfig(**case.cache)

    def make(fast: bool) -> tuple[list[Request], list[Replica], Callable]:
        rep = Replica("r0", sched, cache, case.cost(), fast_forward=fast)
        return to_requests(workload), [rep], lambda _: 0

    stepped, fast, ff_steps, reps = _both(make, monkeypatch)
    _assert_same(stepped, fast)
    stats = reps[0].scheduler.stats
    assert stats.finished_by_reason == {"length": len(workload)}
    for key in case.expect:
        assert getattr(stats, key) > 0, key
    if case.min_share:
        assert ff_steps >= case.min_share * stats.num_steps, (ff_steps, stats.num_steps)
    if name in ("fair", "slo"):
        assert ff_steps == 0  # NOTE: per-step hooks: every step is scheduled as usual


@pytest.mark.parametrize("router", ["round-robin", "kv-aware", "least-loaded"])
def test_fast_forward_in_a_cluster(router: str, monkeypatch: pytest.MonkeyPatch) -> None:
    workload = _general()
    sched, cache = SchedulerConfig(**_DEV), CacheConfig(num_gpu_blocks=1500)

    def make(fast: bool) -> tuple[list[Request], list[Replica], Callable]:
        reps = [Replica(name, sched, cache, _cost(), fast_forward=fast)
                for name in replica_names(3)]
        return to_requests(workload), reps, _Routing(make_router(router), reps, 16)

    stepped, fast, ff_steps, reps = _both(make, monkeypatch)
    _assert_same(stepped, fast)
    assert ff_steps > 0.5 * sum(rep.scheduler.stats.num_steps for rep in reps)


def test_fast_forward_with_groups_and_stop_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parallel sampling (n > 1) and requests that stop on the sampled token (never
    fast-forwarded: each of their steps may be their last)."""
    workload = _random(200, 20.0, "1:600", "2:150", seed=11)

    def requests() -> list[Request]:
        out = []
        for i, w in enumerate(workload):
            params = SamplingParams(max_tokens=w.output_len, ignore_eos=True, n=1 + i % 3)
            if i % 50 == 0:
                params = replace(params, n=1, stop_token_ids=[0], min_tokens=w.output_len - 1)
            out.append(Request(w.request_id, w.prompt_token_ids, params,
                               arrival_time=w.arrival_time))
        return out

    def make(fast: bool) -> tuple[list[Request], list[Replica], Callable]:
        rep = Replica("r0", SchedulerConfig(max_model_len=2048),
                      CacheConfig(num_gpu_blocks=1500), _cost(), fast_forward=fast)
        return requests(), [rep], lambda _: 0

    stepped, fast, ff_steps, reps = _both(make, monkeypatch)
    _assert_same(stepped, fast)
    stats = reps[0].scheduler.stats
    assert stats.finished_by_reason["stop"] > 0 and ff_steps > 0.3 * stats.num_steps


def test_fast_forward_asks_a_stateful_cost_model_the_same(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``MeasuredSteps`` answers each batch with the next time recorded for it: the calls'
    order and arguments must be stepping's."""
    workload = _random(200, 25.0, "16:800", "1:200", seed=12)
    sched, cache = SchedulerConfig(max_model_len=2048), CacheConfig(num_gpu_blocks=700)
    recorder = StepRecorder()
    simulate(workload, sched, cache, _cost(), recorder=recorder)
    # NOTE: every batch measured a little differently each time it ran
    records = [replace(r, end_time_s=r.time_s + r.step_time_s * (1 + (i % 5) / 100))
               for i, r in enumerate(recorder.records)]

    def make(fast: bool) -> tuple[list[Request], list[Replica], Callable]:
        rep = Replica("r0", sched, cache, MeasuredSteps(records, fallback=_cost()),
                      fast_forward=fast)
        return to_requests(workload), [rep], lambda _: 0

    stepped, fast, ff_steps, reps = _both(make, monkeypatch)
    _assert_same(stepped, fast)
    assert ff_steps > 0.5 * reps[0].scheduler.stats.num_steps


def test_a_recorder_steps_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = _Counted(monkeypatch)
    workload = _random(60, 20.0, "16:400", "1:100", seed=13)
    sched, cache = SchedulerConfig(max_model_len=2048), CacheConfig(num_gpu_blocks=700)
    recorder = StepRecorder()
    recorded = simulate(workload, sched, cache, _cost(), recorder=recorder)
    assert counted.steps == 0
    assert len(recorder.records) == recorded.scheduler.stats.num_steps
    fast = simulate(workload, sched, cache, _cost())
    assert counted.steps > 0
    assert ([_request_state(r) for r in recorded.requests]
            == [_request_state(r) for r in fast.requests])
    recorded.metrics.pop("wall_time_s")
    fast.metrics.pop("wall_time_s")
    assert recorded.metrics == fast.metrics
