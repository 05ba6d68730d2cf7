"""``kvloop trace``: summary reproduces the run's metrics, the picture shows the cells, the
Chrome export holds one track per request, and bad input fails with one line."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from matplotlib import image as mpimg
from matplotlib.colors import to_rgb

from kvloop.cli import main
from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core import StepRecorder
from kvloop.executor.simulated import CostModel, get_hardware_spec, get_model_spec
from kvloop.sim.driver import SimulationResult, simulate
from kvloop.sim.workloads import synthetic_workload
from kvloop.viz import grid as grid_mod
from kvloop.viz.grid import LEGEND, Cell, build_grid, select_window
from kvloop.viz.summary import load_records, reconstruct_requests
from kvloop.viz.timeline import DPI, FIGSIZE, plot_timeline

SLO = {"slo_ttft": 0.05, "slo_tpot": 0.01}


def _run(mode: str) -> tuple[SimulationResult, list]:
    wl = synthetic_workload(30, request_rate=40.0, prompt_len="16:200", output_len="2:40", seed=1)
    rec = StepRecorder()
    res = simulate(
        wl,
        SchedulerConfig(max_model_len=1024, max_num_batched_tokens=256, preemption_mode=mode,
                        cost_aware_preemption=False),
        CacheConfig(num_gpu_blocks=24, num_cpu_blocks=64),  # tiny pool: forces preemptions
        CostModel(get_model_spec("llama-3.1-8b"), get_hardware_spec("h100")),
        recorder=rec,
        **SLO,
    )
    return res, rec.records


@pytest.fixture(scope="module", params=["recompute", "swap"])
def run(request, tmp_path_factory) -> tuple[SimulationResult, str]:
    res, records = _run(request.param)
    key = "num_recompute_preemptions" if request.param == "recompute" else "num_swap_preemptions"
    assert res.metrics["scheduler"][key] > 0, "the pool must be small enough to preempt"
    path = tmp_path_factory.mktemp("trace") / f"{request.param}.jsonl"
    path.write_text("".join(r.to_json() + "\n" for r in records))
    return res, str(path)


def _assert_close(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, dict):
        for key, value in want.items():
            assert key in got, f"{where}{key} missing"
            _assert_close(got[key], value, f"{where}{key}.")
    elif isinstance(want, float):
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12), (where, got, want)
    else:
        assert got == want, (where, got, want)


def test_summary_reproduces_the_simulated_metrics(run, tmp_path, capsys):
    res, path = run
    out = tmp_path / "m.json"
    argv = ["trace", "summary", path, "--json", str(out), "--slo-ttft", "0.05"]
    assert main([*argv, "--slo-tpot", "0.01"]) == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    got = json.loads(out.read_text())
    want = dict(res.metrics)
    want.pop("wall_time_s")
    want["scheduler"] = dict(want["scheduler"])
    want["scheduler"].pop("num_cpu_blocks")  # records do not carry the host pool size
    # The simulator leaves Request.num_recomputed_tokens at 0; the trace derives it per
    # request, and over completed requests it must equal the scheduler's total.
    want.pop("recomputed_tokens")
    _assert_close(got, want)
    assert got["recomputed_tokens"] == want["scheduler"]["recomputed_tokens"]
    assert 0 < got["goodput"] < got["request_throughput"]


def test_reconstructed_requests_match_the_scheduler_exactly(run):
    res, path = run
    rebuilt = reconstruct_requests(load_records(path))
    assert set(rebuilt) == {r.request_id for r in res.requests}
    for r in res.requests:
        t = rebuilt[r.request_id]
        assert t.status == r.status.name and t.num_prompt_tokens == r.num_prompt_tokens
        assert t.arrival_time == r.arrival_time
        assert t.first_scheduled_time == r.first_scheduled_time
        assert t.first_token_time == r.first_token_time
        assert t.token_times == r.token_times and t.finished_time == r.finished_time
        assert t.num_preemptions == r.num_preemptions


def test_table_compares_line_by_line_with_simulate(tmp_path, capsys):
    steps = tmp_path / "steps.jsonl"
    sim = ["simulate", "--trace", "azure-conv", "--num-requests", "60", "--rate-scale", "8",
           "--num-gpu-blocks", "800", "--no-progress", "--trace-out", str(steps)]
    assert main(sim) == 0
    sim_lines = capsys.readouterr().out.splitlines()
    assert main(["trace", "summary", str(steps)]) == 0
    trace_lines = capsys.readouterr().out.splitlines()
    skip = ("KV blocks (device / host)", "Simulation wall time")
    keep = [line for line in sim_lines[2:] if not line.startswith(skip)]  # header, cost model
    assert keep == [line for line in trace_lines[1:] if not line.startswith(skip)]


def _pixel(img, geom, row: int, col: int) -> tuple[float, float, float]:
    # Off-centre, so a token-count label in the middle of a prefill cell is not sampled.
    x, y = geom.cell_point(row, col, 0.2, 0.25)
    return tuple(float(v) for v in img[y, x, :3])


def test_plot_cells_have_their_legend_colours(tmp_path):
    _, records = _run("recompute")
    window = select_window(records, (0, 60), 12)
    grid = build_grid(records, window)
    assert grid.cells.shape == (12, 60)
    png = tmp_path / "t.png"
    geom = plot_timeline(grid, str(png))
    img = mpimg.imread(str(png))
    assert img.shape[:2] == (int(FIGSIZE[1] * DPI), int(FIGSIZE[0] * DPI))
    assert (geom.width_px, geom.height_px) == (img.shape[1], img.shape[0])
    for cell in (Cell.PREFILL, Cell.DECODE, Cell.WAITING, Cell.FINISHED, Cell.NONE):
        rows, cols = (grid.cells == cell).nonzero()
        assert len(rows), f"no {cell.name} cell in the window"
        for r, c in list(zip(rows, cols, strict=True))[:3]:
            got = _pixel(img, geom, int(r), int(c))
            assert got == pytest.approx(to_rgb(LEGEND[cell][1]), abs=0.02), (cell, r, c)
    # The first request's first step is its prefill, in the top-left cell.
    first = records[0].scheduled[0]
    assert grid.request_ids[0] == first.request_id and grid.cells[0, 0] == Cell.PREFILL
    assert grid.tokens[0, 0] == first.num_tokens


def test_plot_marks_preemptions_and_swaps(run):
    res, path = run
    records = load_records(path)
    grid = build_grid(records, select_window(records, None, 1000))
    swap = res.metrics["scheduler"]["num_swap_preemptions"] > 0
    marks = (grid.cells == (Cell.SWAPPED if swap else Cell.PREEMPTED)).sum()
    assert marks >= res.metrics["scheduler"]["num_preemptions"]
    if not swap:
        assert (grid.cells == Cell.RECOMPUTE).any()
    # After its finish step a request's row stays empty.
    for r in range(len(grid.request_ids)):
        done = (grid.cells[r] == Cell.FINISHED).nonzero()[0]
        assert len(done) == 1 and (grid.cells[r, done[0] + 1 :] == Cell.NONE).all()


def test_windowing(monkeypatch, tmp_path, capsys):
    _, records = _run("recompute")
    w = select_window(records, (10, 40), None)
    assert [r.step for r in records[w.lo : w.hi]] == list(range(10, 40)) and not w.notes
    arrivals = {rid: i for i, rec in enumerate(records) for rid, *_ in rec.arrived}
    ids = [list(arrivals)[6], list(arrivals)[2]]
    w = select_window(records, None, ids)  # without --steps: the requests' whole lives
    assert w.request_ids == ids and w.lo == arrivals[ids[1]]
    assert any(rid in ids for rid, _ in records[w.hi - 1].finished)
    monkeypatch.setattr(grid_mod, "MAX_STEPS", 50)
    monkeypatch.setattr(grid_mod, "MAX_REQUESTS", 10)
    w = select_window(records, None, None)
    assert (w.lo, w.hi, len(w.request_ids)) == (0, 50, 10) and w.notes
    path = tmp_path / "t.jsonl"
    path.write_text("".join(r.to_json() + "\n" for r in records))
    assert main(["trace", "plot", str(path), "-o", str(tmp_path / "a.png")]) == 0
    out = capsys.readouterr().out
    assert "note:" in out and "--steps A:B" in out
    png = tmp_path / "b.png"
    assert main(["trace", "plot", str(path), "-o", str(png), "--steps", "5:25",
                 "--requests", "4"]) == 0
    assert "4 requests x 20 steps (5:25)" in capsys.readouterr().out and png.exists()


def test_chrome_export(run, tmp_path, capsys):
    res, path = run
    out = tmp_path / "chrome.json"
    assert main(["trace", "export", path, "--chrome", str(out)]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    records = load_records(path)
    assert {e["ph"] for e in events} == {"M", "X", "i", "C"}
    tracks = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    assert tracks.pop("engine steps") == 0
    assert set(tracks) == {r.request_id for r in res.requests}
    by_tid: dict[int, list[dict]] = {}
    for e in events:
        if e["ph"] in "Xi":
            by_tid.setdefault(e["tid"], []).append(e)
            assert e["ts"] >= 0 and e.get("dur", 0) >= 0
    assert len([e for e in by_tid[0] if e["ph"] == "X"]) == len(records)
    for rid, tid in tracks.items():
        ran = [e for e in by_tid[tid] if e["name"] in ("prefill", "decode", "recompute")]
        assert len(ran) == sum(e.request_id == rid for rec in records for e in rec.scheduled)
        assert sum(e["args"]["tokens"] for e in ran) > 0
        assert [e["name"] for e in by_tid[tid] if e["ph"] == "i"].count("finished") == 1
    instants = [e["name"] for e in events if e["ph"] == "i"]
    s = res.metrics["scheduler"]
    assert instants.count("preempted (recompute)") == s["num_recompute_preemptions"]
    assert instants.count("swapped out") == s["num_swap_preemptions"]
    counters = [e for e in events if e["ph"] == "C"]
    assert len(counters) == 3 * len(records)
    assert {"used", "pool"} <= set(counters[0]["args"])


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        (None, [], "not found"),
        ("hello\n", [], "line 1 is not a step record"),
        ('{"step": 0}\n', [], "line 1 is not a step record"),
        ("\n", [], "no step records"),
        ("RECORDS", ["--steps", "9:3"], "--steps"),
        ("RECORDS", ["--steps", "a:b"], "--steps"),
        ("RECORDS", ["--steps", "12"], "--steps"),
        ("RECORDS", ["--steps", "100000:100010"], "selects no step"),
        ("RECORDS", ["--requests", "nobody"], "not in the trace"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, content, extra, message):
    path = tmp_path / "t.jsonl"
    if content == "RECORDS":
        _, records = _run("swap")
        content = "".join(r.to_json() + "\n" for r in records[:40])
    if content is not None:
        path.write_text(content)
    action = ["plot", str(path), "-o", str(tmp_path / "x.png")] if extra else ["summary", str(path)]
    assert main(["trace", *action, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvloop: error:") and message in err[0], err
