"""The cluster simulator: N schedulers on one virtual clock behind the real routers."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Mapping

import pytest

from kvloop.cli import main
from kvloop.cluster.routers import ReplicaLoad, RoundRobinRouter, RouteRequest
from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.executor.simulated import CostModel, get_hardware_spec, get_model_spec
from kvloop.sim.cluster import replica_names, simulate_cluster
from kvloop.sim.driver import simulate
from kvloop.sim.traces import WorkloadRequest, load_trace
from kvloop.sim.workloads import synthetic_workload

COST = CostModel(get_model_spec("llama-3.1-8b"), get_hardware_spec("h100"))
SCHED = SchedulerConfig(max_model_len=4096)
CACHE = CacheConfig(num_gpu_blocks=1500, num_cpu_blocks=100)
_RUN_ONLY = ("wall_time_s", "replicas", "cluster")


def _same_run(a: dict, b: dict) -> dict:
    return {k: v for k, v in a.items() if k not in _RUN_ONLY}, {
        k: v for k, v in b.items() if k not in _RUN_ONLY}


def _shared_prefixes(num_prefixes: int, per_prefix: int, prefix_len: int = 1024,
                     gap: float = 0.05) -> list[WorkloadRequest]:
    """Requests cycling over a few long shared prefixes, each with its own 64-token tail."""
    out = []
    for i in range(num_prefixes * per_prefix):
        p = i % num_prefixes
        prefix = range(p * 100_000, p * 100_000 + prefix_len)
        tail = range(10_000_000 + 64 * i, 10_000_000 + 64 * (i + 1))
        out.append(WorkloadRequest(f"q{i}", i * gap, [*prefix, *tail], 16))
    return out


@pytest.mark.parametrize("router", ["round-robin", "kv-aware"])
def test_one_replica_is_simulate(router):
    wl = synthetic_workload(150, request_rate=40.0, prompt_len="16:2000", output_len="1:200",
                            seed=7)
    cache = CacheConfig(num_gpu_blocks=300, num_cpu_blocks=100)  # small: it preempts
    a = simulate(wl, SCHED, cache, COST)
    b = simulate_cluster(wl, SCHED, cache, COST, num_replicas=1, router=router)
    assert a.metrics["scheduler"]["num_preemptions"] > 0
    left, right = _same_run(a.metrics, b.metrics)
    assert left == right
    assert b.metrics["cluster"]["num_replicas"] == 1
    assert b.metrics["replicas"][0]["requests"] == 150


def test_one_replica_is_simulate_on_a_mooncake_slice():
    wl = load_trace("mooncake", num_requests=80, rate_scale=2.0)
    sched = SchedulerConfig(max_model_len=131072)
    cache = CacheConfig(num_gpu_blocks=6000, num_cpu_blocks=256)
    a = simulate(wl, sched, cache, COST)
    b = simulate_cluster(wl, sched, cache, COST, num_replicas=1, router="kv-aware")
    assert a.metrics["scheduler"]["prefix_cache_hits"] > 0
    left, right = _same_run(a.metrics, b.metrics)
    assert left == right


def test_round_robin_spreads_evenly():
    wl = synthetic_workload(40, request_rate=100.0, prompt_len=200, output_len=8, seed=1)
    res = simulate_cluster(wl, SCHED, CACHE, COST, num_replicas=4, router="round-robin")
    assert [row["requests"] for row in res.metrics["replicas"]] == [10] * 4
    assert [row["replica"] for row in res.metrics["replicas"]] == ["r0", "r1", "r2", "r3"]
    assert res.metrics["completed"] == 40


def test_kv_aware_keeps_a_prefix_on_one_replica_and_hits_more():
    wl = _shared_prefixes(num_prefixes=3, per_prefix=12)  # 3 prefixes: round-robin mixes them
    rates = {}
    for router in ("round-robin", "kv-aware"):
        res = simulate_cluster(wl, SCHED, CACHE, COST, num_replicas=8, router=router)
        rates[router] = res.metrics["cluster"]["prefix_cache_hit_rate"]
        where = {r.request_id: rep.name for rep in res.replicas for r in rep.requests}
        homes = [Counter(where[f"q{i}"] for i in range(p, len(wl), 3)) for p in range(3)]
        if router == "kv-aware":
            assert all(len(h) == 1 for h in homes), homes
            assert len({next(iter(h)) for h in homes}) == 3  # new prefixes to idle replicas
    assert rates["kv-aware"] > 1.5 * rates["round-robin"], rates
    assert rates["kv-aware"] > 0.8


@pytest.mark.parametrize("router", ["round-robin", "least-loaded", "kv-aware"])
def test_every_replica_ends_empty(router):
    wl = synthetic_workload(120, request_rate=200.0, prompt_len="16:1500", output_len="1:150",
                            seed=2)
    cache = CacheConfig(num_gpu_blocks=200, num_cpu_blocks=50, block_size=16)
    sched = SchedulerConfig(max_model_len=2048, preemption_mode="swap")
    res = simulate_cluster(wl, sched, cache, COST, num_replicas=3, router=router)
    assert res.metrics["completed"] == 120
    assert res.metrics["scheduler"]["num_preemptions"] > 0  # small pools: it preempts
    assert sum(row["requests"] for row in res.metrics["replicas"]) == 120
    for rep in res.replicas:
        rep.scheduler.check_invariants()
        assert not rep.scheduler.requests and not rep.pending and not rep.busy
        assert rep.scheduler.kv.num_used_blocks == 0 and rep.scheduler.kv.usage == 0
    busy = [row["busy_time"] for row in res.metrics["replicas"]]
    assert res.metrics["cluster"]["imbalance"] == pytest.approx(max(busy) / (sum(busy) / 3))


class _Spy(RoundRobinRouter):
    """Round-robin that keeps the loads it was shown."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, ReplicaLoad]] = []

    def rank(self, request: RouteRequest, loads: Mapping[str, ReplicaLoad]) -> list[str]:
        self.seen.append(dict(loads))
        return super().rank(request, loads)


def test_router_sees_the_step_in_flight():
    # r0 prefills a 2000-token prompt for one output token; arrivals come while it runs.
    wl = [WorkloadRequest("a", 0.0, range(2000), 1),
          WorkloadRequest("b", 1e-4, range(5000, 5100), 1),
          WorkloadRequest("c", 2e-4, range(6000, 6100), 1)]
    spy = _Spy()
    res = simulate_cluster(wl, SCHED, CACHE, COST, num_replicas=2, router=spy)
    r0_at_c = spy.seen[2]["r0"]
    # "a" is finished in the scheduler already (its step ran whole at its start), but the
    # router sees r0 as it was when the step was scheduled: one running, KV in use.
    assert r0_at_c.num_running == 1 and r0_at_c.kv_usage > 0
    assert r0_at_c.num_waiting == 0
    a, b, c = sorted(res.requests, key=lambda r: r.request_id)
    assert c.first_scheduled_time == a.first_token_time  # joined r0's next step only
    assert b.first_scheduled_time == b.arrival_time  # r1 was idle


def test_replica_names_sort_numerically():
    names = replica_names(12)
    assert names[0] == "r00" and names[-1] == "r11" and sorted(names) == names


def test_cli_cluster_json_and_table(tmp_path, capsys):
    out = tmp_path / "m.json"
    rc = main(["simulate", "--num-requests", "60", "--request-rate", "50", "--prompt-len",
               "64:512", "--output-len", "4:32", "--replicas", "3", "--router", "least-loaded",
               "--json", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "per replica (router: least-loaded)" in text and "r2" in text
    assert "Load imbalance, max/mean busy time" in text
    m = json.loads(out.read_text())
    assert m["cluster"]["router"] == "least-loaded" and m["cluster"]["num_replicas"] == 3
    assert [row["replica"] for row in m["replicas"]] == ["r0", "r1", "r2"]
    assert sum(row["requests"] for row in m["replicas"]) == 60 == m["completed"]


_KINDS = (", total", "mean over replicas", "max over replicas", "whole cluster", "max/mean")
"""What a cluster summary line says about how it aggregates the replicas."""


def _section(lines: list[str], title: str) -> dict[str, str]:
    """The label -> value lines of the summary section headed ``--- title ---``."""
    start = next(i for i, line in enumerate(lines) if f" {title} " in line) + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith(("-", "=")))
    return dict(line.split(":", 1) for line in lines[start:end])


def test_cli_cluster_summary_says_how_each_line_aggregates(tmp_path, capsys):
    out = tmp_path / "m.json"
    rc = main(["simulate", "--num-requests", "60", "--request-rate", "50", "--prompt-len",
               "64:512", "--output-len", "4:32", "--replicas", "3", "--router", "kv-aware",
               "--num-gpu-blocks", "700", "--json", str(out), "--no-progress"])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    m = json.loads(out.read_text())
    assert any("Serving Benchmark Result: whole cluster" in line for line in lines)
    load, sched = _section(lines, "Load"), _section(lines, "Scheduler: 3 replicas")
    for label in [*load, *sched]:
        if label != "Simulation wall time (s)":
            assert any(kind in label for kind in _KINDS), label
    # the hit rate once (the per-replica table has its own column), and as the cluster's
    assert sum("hit rate" in line.lower() for line in lines) == 1
    rate = m["cluster"]["prefix_cache_hit_rate"]
    assert sched["Prefix cache hit rate, whole cluster"].strip() == f"{100 * rate:.1f}%"
    # summed lines are the sums of the replicas', averaged lines the means
    assert sched["KV blocks (device / host), total"].split()[0] == str(3 * 700)
    assert int(sched["Steps, total"]) == sum(row["num_steps"] for row in m["replicas"])
    busy = sum(row["busy_time"] for row in m["replicas"]) / 3
    assert load["Engine busy, mean over replicas"].strip() == \
        f"{100 * busy / m['duration']:.1f}%"
    assert sched["Load imbalance, max/mean busy time"].strip() == \
        f"{m['cluster']['imbalance']:.3f}"
    title = next(i for i, line in enumerate(lines) if "per replica (router: kv-aware)" in line)
    assert lines[title + 1].split() == ["Replica", "Reqs", "Hit", "Busy", "s", "TTFT",
                                        "p50/p99", "ms", "Preem"]
    assert [line.split()[0] for line in lines[title + 2:title + 5]] == ["r0", "r1", "r2"]


def test_cli_one_replica_output_unchanged(tmp_path, capsys):
    out = tmp_path / "m.json"
    args = ["simulate", "--num-requests", "20", "--prompt-len", "64", "--output-len", "4",
            "--json", str(out), "--no-progress"]
    assert main([*args, "--replicas", "1", "--router", "kv-aware"]) == 0
    text = capsys.readouterr().out
    assert "per replica" not in text and "replicas" not in json.loads(out.read_text())
    assert "Prefix cache hit rate:" in text and "KV usage (mean / peak):" in text
    assert not any(kind in text for kind in _KINDS)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvloop.cli", "simulate", "--num-requests",
                           "5", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("args", "needle"), [
    (["--replicas", "0"], "--replicas must be >= 1, got 0"),
    (["--replicas", "-2"], "--replicas must be >= 1"),
    (["--router", "random"], "--router must be one of round-robin, least-loaded, kv-aware"),
    (["--replicas", "2", "--trace-out", "x.jsonl"], "--trace-out"),
])
def test_bad_cluster_flags_are_one_line_and_exit_2(args, needle):
    r = _cli(*args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
