"""The timeline picture a user can read: a time axis where a long step is drawn long, waiting
visible from the moment of arrival, times from the first arrival, labels that fit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from matplotlib import image as mpimg
from matplotlib.colors import to_rgb

from kvloop.cli import main
from kvloop.core.stats import ScheduledEntry, StepRecord
from kvloop.viz.chrome import chrome_trace
from kvloop.viz.grid import LEGEND, Cell, build_grid, select_window, short_ids
from kvloop.viz.timeline import default_title, plot_timeline

CLOCK = 17545.832  # a raw monotonic clock, as a real server records it
LONG = "cmpl-" + "14fa92487d6e495d87dd441b99e98533"
_IDS = (LONG, "cmpl-9f00c2aa77e14b1d8a5e0c3b2d1f4e6a", "cmpl-9f00c2ab00000000000000000000")


def _rec(step: int, start: float, dur: float, *, scheduled=(), arrived=(), finished=(),
         running: int = 0, waiting: int = 0) -> StepRecord:
    entries = [ScheduledEntry(rid, n, kind, ctx) for rid, n, kind, ctx in scheduled]
    return StepRecord(
        step=step, time_s=CLOCK + start, step_time_s=dur, end_time_s=CLOCK + start + dur,
        scheduled=entries, num_batched_tokens=sum(e.num_tokens for e in entries),
        token_budget=2048, preempted=[], num_blocks_swapped_out=0, num_blocks_swapped_in=0,
        swapped_in=[], finished=[(rid, "length") for rid in finished],
        arrived=[(rid, CLOCK + t, 100) for rid, t in arrived],
        sampled=[e.request_id for e in entries if e.kind == "decode" or e.num_tokens < 100],
        kv_blocks_used=10, num_gpu_blocks=100, prefix_cache_queries=0, prefix_cache_hits=0,
        num_running=running, num_waiting=waiting, num_swapped=0,
    )


def _long_step_trace() -> list[StepRecord]:
    """A runs; B's 20 s prefill step; C arrives 10 s into it and waits for the next step."""
    a, b, c = _IDS
    return [
        _rec(0, 0.0, 1.0, scheduled=[(a, 100, "prefill", 0)], arrived=[(a, 0.0)], running=1),
        _rec(1, 1.0, 20.0, scheduled=[(a, 1, "decode", 100), (b, 100, "prefill", 0)],
             arrived=[(b, 0.5)], running=2),
        _rec(2, 21.0, 1.0, scheduled=[(a, 1, "decode", 101), (b, 1, "decode", 100),
                                      (c, 100, "prefill", 0)], arrived=[(c, 11.0)], running=3),
        _rec(3, 22.0, 1.0, scheduled=[(a, 1, "decode", 102), (b, 1, "decode", 101),
                                      (c, 1, "decode", 100)], finished=[a, b, c], running=3),
    ]


def _plot(records, tmp_path: Path, **kw):
    grid = build_grid(records, select_window(records))
    png = tmp_path / "t.png"
    geom = plot_timeline(grid, str(png), **kw)
    return grid, geom, mpimg.imread(str(png))


def _rgb(img, x: float, y: float) -> tuple[float, ...]:
    return tuple(float(v) for v in img[int(y), int(x), :3])


def _colour(cell: Cell) -> tuple[float, float, float]:
    return to_rgb(LEGEND[cell][1])


def test_a_step_20x_longer_is_drawn_20x_wider(tmp_path):
    _, geom, img = _plot(_long_step_trace(), tmp_path)
    widths = [b - a for a, b in (geom.col_px(c) for c in range(4))]
    assert widths[1] == pytest.approx(20 * widths[0], rel=0.02)
    assert widths[0] == pytest.approx(widths[2], abs=1) == pytest.approx(widths[3], abs=1)
    # What is drawn matches: A decodes and B prefills across the whole long step.
    for fx in (0.05, 0.5, 0.95):
        x, y = geom.cell_point(0, 1, fx, 0.25)
        assert _rgb(img, x, y) == pytest.approx(_colour(Cell.DECODE), abs=0.02)
        x, y = geom.cell_point(1, 1, fx, 0.25)
        assert _rgb(img, x, y) == pytest.approx(_colour(Cell.PREFILL), abs=0.02)
    # On the step axis every step is one column.
    _, geom, _ = _plot(_long_step_trace(), tmp_path, x_axis="step")
    widths = [b - a for a, b in (geom.col_px(c) for c in range(4))]
    assert max(widths) - min(widths) < 1


def test_waiting_shows_from_arrival_in_the_middle_of_a_long_step(tmp_path):
    grid, geom, img = _plot(_long_step_trace(), tmp_path)
    row_c = 2
    assert grid.arrivals[row_c] == pytest.approx(CLOCK + 11.0)
    y = geom.top + (row_c + 0.5) * (geom.bottom - geom.top) / geom.num_rows
    # Seconds since the first arrival: C arrived at 11 s, during step 1 (1 s .. 21 s).
    assert _rgb(img, geom.x_px(6.0), y) == pytest.approx((1.0, 1.0, 1.0), abs=0.02)
    for t in (11.5, 16.0, 20.5):
        assert _rgb(img, geom.x_px(t), y) == pytest.approx(_colour(Cell.WAITING), abs=0.02), t
    # B arrived 0.5 s in and waited through step 0 until its prefill.
    y_b = geom.top + 1.5 * (geom.bottom - geom.top) / geom.num_rows
    assert _rgb(img, geom.x_px(0.75), y_b) == pytest.approx(_colour(Cell.WAITING), abs=0.02)


def test_times_count_from_the_first_arrival(tmp_path):
    records = _long_step_trace()
    grid, geom, _ = _plot(records, tmp_path)
    assert grid.t0 == pytest.approx(CLOCK)
    assert geom.col_edges[0] == pytest.approx((0.0, 1.0))
    assert geom.col_edges[-1] == pytest.approx((22.0, 23.0))
    title = default_title(grid)
    assert "0.00–23.00 s after the first arrival" in title
    assert "17545" not in title and "steps 0–3" in title


def test_chrome_export_counts_from_the_first_arrival():
    doc = chrome_trace(_long_step_trace())
    assert doc["otherData"]["origin_s"] == pytest.approx(CLOCK)
    arrived = [e["ts"] for e in doc["traceEvents"] if e.get("name") == "arrived"]
    assert arrived == pytest.approx([0.0, 0.5e6, 11e6])
    steps = [e for e in doc["traceEvents"] if e.get("tid") == 0 and e["ph"] == "X"]
    assert [e["ts"] for e in steps] == pytest.approx([0.0, 1e6, 21e6, 22e6])
    assert steps[1]["dur"] == pytest.approx(20e6)


def test_gaps_between_steps_keep_each_request_state(tmp_path):
    records = _long_step_trace()
    for rec in records[2:]:  # a 5 s pause in the engine after the long step
        rec.time_s += 5.0
        rec.end_time_s += 5.0
    _, geom, img = _plot(records, tmp_path)
    assert geom.col_edges[2][0] == pytest.approx(26.0)
    y = geom.top + 0.5 * (geom.bottom - geom.top) / geom.num_rows
    # A is running but nothing runs in the pause; C keeps waiting.
    assert _rgb(img, geom.x_px(23.5), y) == pytest.approx(_colour(Cell.IDLE), abs=0.02)
    y_c = geom.top + 2.5 * (geom.bottom - geom.top) / geom.num_rows
    assert _rgb(img, geom.x_px(23.5), y_c) == pytest.approx(_colour(Cell.WAITING), abs=0.02)


def test_short_ids():
    ids = list(_IDS)
    short = short_ids(ids)
    assert short[0] == "14fa92487d…"
    assert len(set(short)) == 3 and all(len(s) <= 14 for s in short)
    assert all(rid.removeprefix("cmpl-").startswith(s.rstrip("…")) for rid, s in zip(
        ids, short, strict=True))
    assert short_ids(["10", "11", "12"]) == ["10", "11", "12"]  # no digit stripped
    assert short_ids(["req-1", "req-2"]) == ["1", "2"]
    assert short_ids(["req-1", "req-10"]) == ["1", "10"]
    assert short_ids(["a-b", "a-"]) == ["a-b", "a-"]  # nothing left of an id: keep all
    assert short_ids(["a"]) == ["a"] and short_ids([]) == []


def test_short_ids_label_rows_by_themselves():
    records = _long_step_trace()
    text = "\n".join(r.to_json() for r in records)
    for new, old in enumerate(_IDS):
        text = text.replace(f'"{old}"', f'"{new}"')
    records = [StepRecord.from_dict(json.loads(line)) for line in text.splitlines()]
    grid = build_grid(records, select_window(records))
    assert grid.labels() == ["0", "1", "2"] and not grid.ids_cut
    assert grid.label_title() == "request (id)"
    for new, old in enumerate("012"):
        text = text.replace(f'"{old}"', f'"azure-conv-{new}"')
    records = [StepRecord.from_dict(json.loads(line)) for line in text.splitlines()]
    grid = build_grid(records, select_window(records))
    assert grid.labels() == ["0", "1", "2"]
    assert grid.label_title() == "request (id after 'azure-conv-')"


def test_labels_are_not_cut(tmp_path):
    grid, geom, img = _plot(_long_step_trace(), tmp_path)
    assert grid.labels()[0] == "1 14fa92487d…" and grid.ids_cut
    assert grid.label_title() == "request (row, id after 'cmpl-')"
    # Ink left of the grid (the labels) but none at the image's left edge.
    left = img[int(geom.top):int(geom.bottom), : int(geom.left) - 8, :3]
    ink = np.nonzero((left < 0.5).all(axis=2).any(axis=0))[0]
    assert len(ink) > 20 and ink.min() > 3, ink[:5]


def test_cli_time_axis_and_row_legend(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(r.to_json() + "\n" for r in _long_step_trace()))
    png = tmp_path / "t.png"
    assert main(["trace", "plot", str(path), "-o", str(png)]) == 0
    out = capsys.readouterr().out
    legend = tmp_path / "t.rows.tsv"
    assert "full ids" in out and str(legend) in out
    lines = legend.read_text().splitlines()
    assert lines[0] == "row\trequest_id\tarrival_s" and lines[1] == f"1\t{LONG}\t0.000"
    assert lines[3].endswith("\t11.000")
    assert main(["trace", "plot", str(path), "-o", str(png), "--x-axis", "step"]) == 0
    with pytest.raises(SystemExit):
        main(["trace", "plot", str(path), "-o", str(png), "--x-axis", "steps"])


def test_trace_summary_of_a_real_run_names_no_gpu(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(r.to_json() + "\n" for r in _long_step_trace()))
    assert main(["trace", "summary", str(path)]) == 0
    out = capsys.readouterr().out
    assert "GPU" not in out and "KV blocks (device / host)" in out
    assert "Engine busy (utilisation)" in out and "overloaded" not in out
