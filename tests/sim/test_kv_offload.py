"""The prefix cache's host tier in the simulator: same KV manager, costs from the preset."""

from __future__ import annotations

from dataclasses import replace

from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.executor.simulated import CostModel, get_hardware_spec, get_model_spec
from kvloop.sim.driver import simulate
from kvloop.sim.kv_offload import load_costs, offload_summary, prefix_reuse
from kvloop.sim.traces import WorkloadRequest


def _turns(n: int) -> list[WorkloadRequest]:
    """Conversations of growing prompts (each turn resends the last), interleaved so that a
    conversation's next turn comes after the others pushed its prefix off the device."""
    out = []
    for turn in range(3):
        for c in range(n):
            prompt = [c * 10_000 + i for i in range(512 * (turn + 1))]
            out.append(WorkloadRequest(f"c{c}t{turn}", (turn * n + c) * 0.5, prompt, 8))
    return out


def _run(offload: int, **cache: object):
    model, hw = get_model_spec("llama-3.1-8b"), get_hardware_spec("h100")
    cost = CostModel(model, hw)
    base = CacheConfig(block_size=16, num_gpu_blocks=256, kv_offload_blocks=offload,
                       **cache)  # type: ignore[arg-type]
    if offload:
        per_block, latency, per_token = load_costs(cost, 16)
        base = replace(base, kv_load_s_per_block=per_block, kv_load_latency_s=latency,
                       kv_recompute_s_per_token=per_token)
    return simulate(_turns(12), SchedulerConfig(max_model_len=4096), base, cost)


def test_host_tier_turns_recompute_into_loads() -> None:
    plain, tiered = _run(0), _run(4096)
    assert "kv_offload" not in plain.metrics["scheduler"]
    kv = tiered.metrics["scheduler"]["kv_offload"]
    assert kv["host_hit_blocks"] > 0 and kv["blocks_loaded"] == kv["host_hit_blocks"]
    hit = lambda r: r.metrics["scheduler"]["prefix_cache_hit_rate"]  # noqa: E731
    assert hit(tiered) > 1.5 * hit(plain)
    summary = offload_summary(kv, tiered.requests, 16, 2 << 20)
    assert summary["bytes_loaded"] == kv["blocks_loaded"] * (2 << 20)
    assert prefix_reuse(plain.requests, 16) == prefix_reuse(tiered.requests, 16)


def test_h100_loads_beat_prefill_and_gh200_loads_faster() -> None:
    model = get_model_spec("llama-3.1-8b")
    h100 = load_costs(CostModel(model, get_hardware_spec("h100")), 16)
    gh200 = load_costs(CostModel(model, get_hardware_spec("gh200")), 16)
    assert 0 < gh200[0] < h100[0] / 5  # NVLink-C2C against PCIe Gen5
    assert h100[0] < 16 * h100[2]  # loading a block beats prefilling its 16 tokens


def test_queue_aware_eviction_runs_in_the_simulator() -> None:
    r = _run(0, kv_eviction="queue-aware")
    assert r.metrics["scheduler"]["kv_offload"]["host_hit_blocks"] == 0
    assert all(q.error is None for q in r.requests)


def test_loads_are_pipelined_over_layers_and_stores_hidden() -> None:
    from kvloop.core.interface import CachedRequestData, SchedulerOutput
    from kvloop.executor.simulated.executor import SimulatedExecutor

    model = get_model_spec("llama-3.1-8b")
    ex = SimulatedExecutor(CostModel(model, get_hardware_spec("h100")), 16)

    def step(loads: int, stores: int) -> float:
        out = SchedulerOutput(0, [], CachedRequestData(["a"], [[]], [4000], [False]),
                              {"a": 512}, 512, blocks_to_load=[(0, 0)] * loads,
                              blocks_to_offload=[(0, 0)] * stores)
        return ex.execute(out).step_time_s

    compute, load = step(0, 0), ex._copy_time(200)
    assert load < compute  # 200 blocks hide behind a 512-token chunk, but for one layer
    assert step(200, 0) == compute + load / model.num_layers
    assert step(0, 200) == compute  # stores run beside the step
