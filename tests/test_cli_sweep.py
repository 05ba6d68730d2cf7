"""``kvloop sweep``: grids checked before Ray starts, one Ray task per configuration, a row
per configuration (failed ones too) in CSV and JSON, the Pareto PNG, and Ray shut down after.

The tests marked ``ray`` share one sweep (one local Ray the sweep itself starts and stops);
``-m 'not ray'`` leaves them out."""

from __future__ import annotations

import csv
import json
import math
import os
import random
import re
import time
from pathlib import Path
from typing import Any

import pytest

from kvloop.cli import main
from kvloop.cli.sweep import format_rows, format_warnings, make_row
from kvloop.cli.sweep_grid import Config, build_sweep
from kvloop.viz import pareto
from kvloop.viz.pareto import Panel, mark_pareto, pareto_figure, pareto_mask

# -- the grid, checked before any Ray work ------------------------------------------------

BAD = [
    (["--grid", "max-num-seq=8,64"],
     "--grid max-num-seq: kvloop simulate has no flag --max-num-seq (did you mean "
     "--max-num-seqs?)"),
    (["--grid", "max-num-seqs=8,x"],
     "configuration 2 of 2 (max-num-seqs=x): argument --max-num-seqs: invalid int value: 'x'"),
    (["--grid", "max-num-seqs=8,64", "--", "--bogus"],
     "configuration 1 of 2 (max-num-seqs=8): unrecognized arguments: --bogus"),
    ([], "give at least one --grid NAME=V1,V2,..."),
    (["--", "--num-requests", "5", "--grid", "seed=1,2"],
     "--grid is the sweep's own flag: give it before --"),
    (["--grid", "max-num-seqs="], "--grid 'max-num-seqs=': expected NAME=V1,V2,..."),
    (["--grid", "seed=" + ",".join(map(str, range(1001)))],
     "the grid has 1001 configurations; at most 1000"),
    (["--grid", "json=a.json,b.json"], "--grid json: not a flag to sweep"),
    (["--grid", "max-num-seqs=8,64", "--", "--max-num-seqs", "8"],
     "--max-num-seqs is both after -- and in --grid max-num-seqs"),
    (["--grid", "enable-prefix-caching=yes"],
     "--grid enable-prefix-caching: a switch takes true,false, not 'yes'"),
    (["--grid", "seed=1,2", "--grid", "seed=3"], "--grid seed: the same flag as --grid seed"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[m[:40] for _, m in BAD])
def test_a_bad_grid_is_one_line_and_exit_2_before_ray(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")

    def no_ray(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("Ray started before the grid was checked")

    monkeypatch.setattr(ray, "init", no_ray)
    rc = main(["sweep", "--out", str(tmp_path / "s"), *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"kvloop: error: {message}")
    assert err.count("\n") == 1
    assert not list(tmp_path.iterdir())


def test_grid_values_become_simulate_flags() -> None:
    sweep = build_sweep(["tp=1,2", "enable-prefix-caching=true,false",
                         "priority-mix=0:0.5,1:0.5|0:1"], ["--", "--num-requests", "5"])
    assert len(sweep.configs) == 8
    assert sweep.grid["priority-mix"] == ["0:0.5,1:0.5", "0:1"]
    first, last = sweep.configs[0], sweep.configs[-1]
    assert first.argv == ["--num-requests", "5", "--tensor-parallel-size=1",
                          "--enable-prefix-caching", "--priority-mix=0:0.5,1:0.5"]
    assert last.argv[-2:] == ["--no-enable-prefix-caching", "--priority-mix=0:1"]
    assert last.values == {"tp": "2", "enable-prefix-caching": "false", "priority-mix": "0:1"}
    assert [c.gpus for c in sweep.configs] == [1] * 4 + [2] * 4


def test_rows_take_the_cluster_keys_when_present() -> None:
    config = Config(0, {"max-num-seqs": "8"}, ["--max-num-seqs=8"], 2)
    metrics = {"output_throughput": 10.0, "ttft": {"p50": 0.1, "p99": 0.5},
               "scheduler": {"prefix_cache_hit_rate": 0.25}, "replicas": [{"x": 1}],
               "cluster": {"imbalance": 1.2, "prefix_cache_hit_rate": 0.4,
                           "per_replica": [1, 2], "load": {"busy_max": 3.0}}}
    row = make_row(config, metrics, [])
    assert row["max-num-seqs"] == "8" and row["gpus"] == 2 and row["ttft_p99_s"] == 0.5
    assert row["prefix_hit_rate"] == 0.25 and row["tpot_p50_s"] is None
    assert {k: v for k, v in row.items() if k.startswith("cluster")} == {
        "cluster.imbalance": 1.2, "cluster.prefix_cache_hit_rate": 0.4,
        "cluster.load.busy_max": 3.0}
    assert make_row(config, None, [], "boom")["error"] == "boom"


def _metrics(replicas: int, tok_s: float, hit: float) -> dict[str, Any]:
    """simulate's JSON, the keys the sweep reads; ``cluster`` only with replicas."""
    m: dict[str, Any] = {"completed": 10, "failed": 0, "output_throughput": tok_s,
                         "request_throughput": 1.0, "goodput": 0.5 * replicas,
                         "ttft": {"p50": 0.1, "p99": 1.0 / replicas}, "tpot": {"p50": 0.01},
                         "scheduler": {"prefix_cache_hit_rate": hit}, "slo_ttft": 2.0}
    if replicas > 1:
        m["cluster"] = {"router": "kv-aware", "num_replicas": replicas,
                        "prefix_cache_hit_rate": hit, "imbalance": 1.25}
    return m


def _console(grid: list[str], fixed: list[str]) -> list[list[str]]:
    """format_rows' table of a made-up run of the grid, split into cells."""
    sweep = build_sweep(grid, fixed)
    rows = []
    for c in sweep.configs:
        replicas = int(c.values.get("replicas", fixed[fixed.index("--replicas") + 1]
                                    if "--replicas" in fixed else 1))
        rows.append(make_row(c, _metrics(replicas, 100.0 + c.index, 0.125), []))
    mark_pareto(rows)
    return [re.split(r"\s{2,}", line.strip()) for line in format_rows(sweep, rows).splitlines()]


def test_the_console_table_shows_each_quantity_once() -> None:
    table = _console(["replicas=1,2", "router=round-robin,kv-aware"], ["--num-requests", "5"])
    head = table[0]
    assert head == ["#", "replicas", "router", "GPUs", "out tok/s", "TTFT p50 s", "TTFT p99 s",
                    "TPOT p50 ms", "goodput/s", "prefix hit %", "preempt", "imbalance",
                    "pareto T", "pareto G", "error"]
    assert [line[:3] for line in table[1:]] == [
        ["1", "1", "round-robin"], ["2", "1", "kv-aware"], ["3", "2", "round-robin"],
        ["4", "2", "kv-aware"]]
    assert table[3][head.index("prefix hit %")] == "12.5"
    assert table[3][head.index("imbalance")] == "1.250"
    assert table[1][head.index("imbalance")] == "-"  # one replica: no cluster numbers
    # replicas fixed after --: the cluster's count is the one replicas column
    head = _console(["router=round-robin,kv-aware"], ["--replicas", "4"])[0]
    assert head.count("replicas") == 1 and head.index("replicas") > head.index("preempt")
    assert len(set(head)) == len(head)
    assert not {"num_replicas", "prefix_cache_hit_rate"} & set(head)


def test_warnings_are_printed_once_each_with_their_rows() -> None:
    sweep = build_sweep(["seed=1,2,3"], ["--num-requests", "5"])
    said = [["overloaded: x"], [], ["overloaded: x", "slow: y"]]
    rows = [make_row(c, _metrics(1, 100.0, 0.0), w)
            for c, w in zip(sweep.configs, said, strict=True)]
    assert format_warnings(rows) == ["warning (#1 #3): overloaded: x", "warning (#3): slow: y"]
    assert format_warnings(rows[1:2]) == []


def test_throughput_axes_start_at_zero() -> None:
    xs, ys = [1.0, 2.0, 3.0], [707.1, 710.8, 713.3]  # a 1% spread must not look large
    fig = pareto_figure([Panel(xs, ys, "x", "y", "t")], ["a", "b", "c"])
    assert fig.axes[0].get_ylim()[0] == 0.0


def test_every_pareto_point_is_marked_and_keyed() -> None:
    # 1, 2: the front; 3 tied with 1; 4 dominated right next to 2; 5, 6 dominated, apart
    xs, ys = [1.0, 2.0, 1.0, 2.02, 5.0, 9.0], [10.0, 20.0, 10.0, 19.9, 4.0, 15.0]
    labels = [f"config-{k}" for k in "abcdef"]
    ids = ["1", "2", "3", "4", "7", "9"]
    fig = pareto_figure([Panel(xs, ys, "x", "y", "t"), Panel(xs, ys, "x", "y", "u")],
                        labels, "title", ids, key_title="key")
    for ax in fig.axes:
        texts = [t.get_text() for t in ax.texts]
        assert sorted(n for t in texts for n in re.findall(r"#(\d+)", t)) == sorted(ids)
        assert "#1 config-a (tied: #3)" in texts and "#2 config-b (near: #4)" in texts
        assert "#7" in texts and "#9" in texts
    key = next(t.get_text() for t in fig.texts if t.get_gid() == "pareto-key")
    assert key.splitlines()[0] == "key"
    assert all(f"#{i} {label}" in key for i, label in zip(ids, labels, strict=True))
    many = [str(k) for k in range(pareto.KEY_MAX + 1)]
    assert "too many to list" in pareto._key(many, many, "")


def test_sweep_png_marks_points_by_row_number(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(pareto, "plot_pareto",
                        lambda panels, labels, path, title, **kw: seen.update(labels=labels, **kw))
    rows = [{"error": "", "gpus": 1, "ttft_p99_s": 1.0, "output_tok_s": 10.0,
             "goodput_req_s": 1.0, "slo_ttft_s": None, "slo_tpot_s": None},
            {"error": "failed", "gpus": 1, "ttft_p99_s": None, "output_tok_s": None,
             "goodput_req_s": None, "slo_ttft_s": None, "slo_tpot_s": None},
            {"error": "", "gpus": 2, "ttft_p99_s": 2.0, "output_tok_s": 5.0,
             "goodput_req_s": 1.5, "slo_ttft_s": None, "slo_tpot_s": None}]
    mark_pareto(rows)
    assert pareto.plot_sweep(rows, ["a", "b", "c"], str(tmp_path / "p.png"))
    assert seen["labels"] == ["a", "c"] and seen["ids"] == ["1", "3"]


def test_pareto_mask() -> None:
    # smaller x and larger y are better
    xs = [1.0, 2.0, 2.0, 3.0, 1.0, 4.0]
    ys = [5.0, 6.0, 4.0, 6.0, 5.0, 9.0]
    assert pareto_mask(xs, ys) == [True, True, False, False, True, True]
    assert pareto_mask([], []) == []
    rng = random.Random(0)  # against the definition, with many ties
    for _ in range(200):
        pts = [(rng.randint(0, 4), rng.randint(0, 4)) for _ in range(rng.randint(1, 8))]
        brute = [not any(qx <= px and qy >= py and (qx, qy) != (px, py) for qx, qy in pts)
                 for px, py in pts]
        assert pareto_mask([x for x, _ in pts], [y for _, y in pts]) == brute, pts


def test_mark_pareto_skips_failed_rows() -> None:
    rows = [{"error": "", "gpus": 1, "ttft_p99_s": 1.0, "output_tok_s": 10.0,
             "goodput_req_s": 1.0},
            {"error": "", "gpus": 2, "ttft_p99_s": 2.0, "output_tok_s": 5.0,
             "goodput_req_s": 1.5},
            {"error": "failed", "gpus": 1, "ttft_p99_s": None, "output_tok_s": None,
             "goodput_req_s": None}]
    mark_pareto(rows)
    assert [r["pareto_ttft"] for r in rows] == [True, False, None]
    assert [r["pareto_cost"] for r in rows] == [True, True, None]


# -- one real sweep on a local Ray ---------------------------------------------------------

def _descendants(pid: int) -> list[str]:
    """Command lines of the live (not zombie) processes below ``pid`` (Linux /proc)."""
    parent, cmd = {}, {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            state, ppid = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[:2]
            raw = Path(f"/proc/{entry}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if state != "Z":
            parent[int(entry)] = int(ppid)
            cmd[int(entry)] = raw.replace(b"\0", b" ").decode(errors="replace")
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        children = [c for c, pp in parent.items() if pp == p]
        found += [cmd[c] for c in children]
        frontier += children
    return found


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One sweep of four tiny configurations (two can never run: one KV block) on a local
    Ray of two CPUs that the sweep starts and shuts down."""
    pytest.importorskip("ray")
    prefix = tmp_path_factory.mktemp("sweep") / "out" / "s"
    start = time.perf_counter()
    rc = main(["sweep", "--workers", "2", "--no-progress", "--out", str(prefix),
               "--grid", "max-num-seqs=8,64", "--grid", "num-gpu-blocks=1,20000",
               "--", "--num-requests", "30", "--slo-ttft", "2"])
    return {"rc": rc, "prefix": prefix, "seconds": time.perf_counter() - start}


@pytest.mark.ray
def test_one_row_per_configuration(swept: dict[str, Any]) -> None:
    assert swept["rc"] == 1  # some configuration failed
    prefix = swept["prefix"]
    data = json.loads(Path(f"{prefix}.json").read_text())
    rows = data["rows"]
    assert data["grid"] == {"max-num-seqs": ["8", "64"], "num-gpu-blocks": ["1", "20000"]}
    assert data["simulate_args"] == ["--num-requests", "30", "--slo-ttft", "2"]
    assert [(r["max-num-seqs"], r["num-gpu-blocks"]) for r in rows] == [
        ("8", "1"), ("8", "20000"), ("64", "1"), ("64", "20000")]
    with open(f"{prefix}.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 4 and list(table[0]) == data["columns"]
    for row, line in zip(rows, table, strict=True):
        if row["num-gpu-blocks"] == "1":
            continue
        assert not row["error"] and row["completed"] == 30 and row["gpus"] == 1
        for column in ("output_tok_s", "goodput_req_s", "ttft_p50_s", "ttft_p99_s",
                       "tpot_p50_s", "prefix_hit_rate"):
            assert math.isfinite(row[column]) and row[column] >= 0, column
            assert float(line[column]) == pytest.approx(row[column])
        assert row["slo_ttft_s"] == 2.0
        assert row["args"].endswith(f"--num-gpu-blocks={row['num-gpu-blocks']}")
    # more sequences per step: more throughput, shorter queues
    assert rows[3]["output_tok_s"] > rows[1]["output_tok_s"]
    assert rows[3]["pareto_ttft"] is True and rows[1]["pareto_ttft"] is False


@pytest.mark.ray
def test_a_failed_configuration_is_an_error_row(swept: dict[str, Any]) -> None:
    rows = json.loads(Path(f"{swept['prefix']}.json").read_text())["rows"]
    for row in (rows[0], rows[2]):
        assert row["error"].startswith("30 of 30 requests can never run")
        assert row["output_tok_s"] is None and row["pareto_ttft"] is None


@pytest.mark.ray
def test_the_pareto_png_and_ray_is_gone(swept: dict[str, Any]) -> None:
    png = Path(f"{swept['prefix']}.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    import ray

    assert not ray.is_initialized()
    deadline = time.monotonic() + 20
    while (left := [c for c in _descendants(os.getpid()) if "ray" in c]) and \
            time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left
