"""Why a request waited: ``trace summary`` has per-tenant rows that match the
simulator's, and ``trace plot`` labels rows with tenant and priority and marks requests that
missed their TTFT target at their deadline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from matplotlib import image as mpimg
from matplotlib.colors import to_rgb

from kvloop.cli import main
from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core import StepRecorder
from kvloop.core.stats import ScheduledEntry, StepRecord
from kvloop.executor.simulated import CostModel, get_hardware_spec, get_model_spec
from kvloop.sim.driver import SimulationResult, simulate
from kvloop.sim.workloads import apply_tenant_mix, synthetic_workload
from kvloop.viz.grid import build_grid, select_window
from kvloop.viz.slo import row_infos, row_suffix
from kvloop.viz.summary import reconstruct_requests
from kvloop.viz.timeline import MISSED_TTFT, plot_timeline


def _run(policy: str, **sched) -> tuple[SimulationResult, list[StepRecord]]:
    wl = synthetic_workload(40, request_rate=60.0, prompt_len="16:200", output_len="2:30", seed=3)
    apply_tenant_mix(wl, [0.6, 0.2, 0.2], seed=3)
    rec = StepRecorder()
    res = simulate(
        wl,
        SchedulerConfig(max_model_len=1024, max_num_batched_tokens=256, policy=policy, **sched),
        CacheConfig(num_gpu_blocks=32, num_cpu_blocks=0),
        CostModel(get_model_spec("llama-3.1-8b"), get_hardware_spec("h100")),
        recorder=rec,
    )
    return res, rec.records


def _write(records: list[StepRecord], path: Path) -> str:
    path.write_text("".join(r.to_json() + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def slo_run() -> tuple[SimulationResult, list[StepRecord]]:
    res, records = _run("slo", slo_ttft=0.02, slo_tpot=0.05, slo_overload="reject")
    assert res.metrics["rejected"] > 0, "the SLO must be tight enough to reject some"
    return res, records


def test_summary_has_the_simulators_tenant_rows(slo_run, tmp_path, capsys) -> None:
    res, records = slo_run
    out = tmp_path / "m.json"
    assert main(["trace", "summary", _write(records, tmp_path / "t.jsonl"),
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Tenants" in text and "Rejected requests" in text
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("Tenant "))
    assert [line.split()[0] for line in lines[head + 1:head + 4]] == ["t0", "t1", "t2"]
    got = json.loads(out.read_text())
    want = res.metrics
    assert got["rejected"] == want["rejected"]
    assert set(got["tenants"]) == {"t0", "t1", "t2"}
    for name, row in want["tenants"].items():
        for key in ("requests", "completed", "rejected", "service_tokens", "ttft_mean",
                    "ttft_p99"):
            assert got["tenants"][name][key] == pytest.approx(row[key]), (name, key)
    n = sum(got[k] for k in ("completed", "aborted", "failed", "rejected", "unfinished"))
    assert f"{n} requests over" in text


def test_rebuilt_requests_carry_tenant_and_targets(slo_run) -> None:
    res, records = slo_run
    rebuilt = reconstruct_requests(records)
    for r in res.requests:
        t = rebuilt[r.request_id]
        assert (t.tenant, t.priority, t.slo_ttft) == (r.tenant, r.priority, 0.02)
        assert t.status == r.status.name


def _rec(step: int, start: float, dur: float, *, scheduled=(), arrived=(), info=None,
         sampled=(), finished=()) -> StepRecord:
    return StepRecord(
        step=step, time_s=start, step_time_s=dur, end_time_s=start + dur,
        scheduled=[ScheduledEntry(rid, n, kind, 0) for rid, n, kind in scheduled],
        num_batched_tokens=sum(n for _, n, _ in scheduled), token_budget=64, preempted=[],
        num_blocks_swapped_out=0, num_blocks_swapped_in=0, swapped_in=[],
        finished=list(finished), arrived=list(arrived), sampled=list(sampled),
        kv_blocks_used=1, num_gpu_blocks=8, prefix_cache_queries=0, prefix_cache_hits=0,
        num_running=1, num_waiting=0, num_swapped=0, arrived_info=info or {})


def _slo_trace() -> list[StepRecord]:
    """'a' (acme, on time: target 1 s), 'b' (acme, priority 2, target 0.5 s, first token at
    2 s: missed), 'c' (no info), 'd' (rejected at 1.5 s; target 1 s: missed)."""
    info = {"a": {"tenant": "acme", "slo_ttft": 1.0},
            "b": {"tenant": "acme", "priority": 2, "slo_ttft": 0.5},
            "d": {"tenant": "a-very-long-tenant-name", "slo_ttft": 1.0}}
    arrived = [("a", 0.0, 8), ("b", 0.0, 8), ("c", 0.0, 8), ("d", 0.0, 8)]
    return [
        _rec(0, 0.0, 1.0, scheduled=[("a", 8, "prefill"), ("c", 8, "prefill")],
             arrived=arrived, info=info, sampled=["a", "c"]),
        _rec(1, 1.0, 1.0, scheduled=[("b", 8, "prefill")], sampled=["b"],
             finished=[("a", "length"), ("c", "length"), ("d", "rejected")]),
        _rec(2, 2.0, 1.0, scheduled=[("b", 1, "decode")], sampled=["b"],
             finished=[("b", "length")]),
    ]


def test_rows_know_tenant_priority_and_missed_targets() -> None:
    infos = row_infos(_slo_trace(), ["a", "b", "c", "d"])
    assert [(i.tenant, i.priority, i.ttft_deadline, i.missed_ttft) for i in infos] == [
        ("acme", 0, 1.0, False), ("acme", 2, 0.5, True), ("", 0, None, False),
        ("a-very-long-tenant-name", 0, 1.0, True)]
    assert [row_suffix(i) for i in infos] == ["acme", "acme p2", "", "a-very-long-…"]


def test_labels_name_tenant_and_priority() -> None:
    records = _slo_trace()
    grid = build_grid(records, select_window(records))
    assert grid.labels() == ["a acme", "b acme p2", "c", "d a-very-long-…"]
    assert grid.label_title() == "request (id; tenant, p = priority)"


@pytest.mark.parametrize("x_axis", ["time", "step"])
def test_plot_marks_missed_ttft_at_the_deadline(tmp_path, x_axis) -> None:
    records = _slo_trace()
    grid = build_grid(records, select_window(records))
    path = tmp_path / "t.png"
    geom = plot_timeline(grid, str(path), x_axis=x_axis)
    want = (0.5, 1.0) if x_axis == "time" else (0.0, 0.5)  # step 0 spans [-0.5, 0.5]
    assert geom.ttft_marks == ((1, want[0]), (3, want[1]))
    img = mpimg.imread(str(path))
    h = (geom.bottom - geom.top) / geom.num_rows
    for row, x in geom.ttft_marks:
        px, py = int(geom.x_px(x)), int(geom.top + (row + 0.45) * h)
        near = img[py - 2:py + 3, px - 2:px + 3, :3].reshape(-1, 3)
        assert any(abs(c - to_rgb(MISSED_TTFT[1])).max() < 0.08 for c in near), (row, x)


def test_plot_without_targets_draws_no_marks(tmp_path) -> None:
    records = _slo_trace()
    for rec in records:
        rec.arrived_info = {}
    grid = build_grid(records, select_window(records))
    assert grid.labels() == ["a", "b", "c", "d"]
    assert plot_timeline(grid, str(tmp_path / "t.png")).ttft_marks == ()


def test_cli_plot_of_a_policy_run(slo_run, tmp_path, capsys) -> None:
    _, records = slo_run
    png = tmp_path / "t.png"
    assert main(["trace", "plot", _write(records, tmp_path / "t.jsonl"), "-o", str(png)]) == 0
    assert png.exists() and "requests x" in capsys.readouterr().out


def test_rows_legend_names_full_tenants() -> None:
    from kvloop.cli.trace import rows_legend

    records = _slo_trace()
    lines = rows_legend(build_grid(records, select_window(records))).splitlines()
    assert lines[0] == "row\trequest_id\tarrival_s\ttenant\tpriority"
    assert lines[2] == "2\tb\t0.000\tacme\t2"
    assert lines[4] == "4\td\t0.000\ta-very-long-tenant-name\t0"


def test_summary_slo_flags_replace_the_recorded_targets(slo_run) -> None:
    from kvloop.viz.summary import summarize_trace

    _, records = slo_run
    recorded = summarize_trace(records)
    loose = summarize_trace(records, slo_ttft=1e6, slo_tpot=1e6)
    tight = summarize_trace(records, slo_ttft=1e-9, slo_tpot=1e-9)
    assert loose["goodput"] == pytest.approx(loose["request_throughput"])
    assert not tight["goodput"]
    # NOTE: the recorded targets (0.02 s / 0.05 s) are what the summary uses without flags;
    # whether any completed request misses them depends on the scheduler, so compare
    # with flags at those values and at a tighter TTFT rather than with the loose ones.
    same = summarize_trace(records, slo_ttft=0.02, slo_tpot=0.05)
    tighter = summarize_trace(records, slo_ttft=0.01, slo_tpot=0.05)
    assert recorded["goodput"] == pytest.approx(same["goodput"])
    assert 0 < tighter["goodput"] < recorded["goodput"] <= loose["goodput"]
