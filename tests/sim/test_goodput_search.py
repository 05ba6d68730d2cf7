"""DistServe goodput: the rate search, arrival rescaling and ``simulate --find-goodput``."""

from __future__ import annotations

import json

import pytest

from kvloop.cli.main import main
from kvloop.sim.goodput import find_goodput, parse_rate_range, rescale_arrivals
from kvloop.sim.traces import WorkloadRequest


def test_bisection_finds_the_crossing():
    found = find_goodput(lambda r: 1.0 if r <= 7.3 else 0.5, 1.0, 20.0, rel_tol=0.01)
    assert found.bound == "found" and found.goodput == pytest.approx(7.3, rel=0.02)
    assert found.goodput <= 7.3
    assert find_goodput(lambda r: 0.0, 1.0, 2.0).bound == "below"
    above = find_goodput(lambda r: 0.95, 1.0, 2.0)
    assert (above.bound, above.goodput, len(above.probes)) == ("above", 2.0, 2)


@pytest.mark.parametrize("bad", ["3", "0:5", "5:2", "a:b", ":"])
def test_rate_range_errors_name_the_flag(bad):
    with pytest.raises(ValueError, match="--find-goodput expects LO:HI"):
        parse_rate_range(bad)
    assert parse_rate_range("0.5:12") == (0.5, 12.0)


def _w(times):
    return [WorkloadRequest(f"r{i}", t, range(4), 2) for i, t in enumerate(times)]


def test_rescale_keeps_the_shape_or_draws_poisson():
    out = rescale_arrivals(_w([10.0, 11.0, 13.0]), 4.0)  # native 2/3 req/s -> 4 req/s
    assert [w.arrival_time for w in out] == pytest.approx([0.0, 1 / 6, 0.5])
    poisson = rescale_arrivals(_w([0.0] * 400), 10.0, seed=1)
    span = poisson[-1].arrival_time
    assert 399 / span == pytest.approx(10.0, rel=0.15)
    with pytest.raises(ValueError, match="rate must be > 0"):
        rescale_arrivals(_w([0.0]), 0.0)


def test_simulate_find_goodput(tmp_path, capsys):
    out = tmp_path / "g.json"
    rc = main(["simulate", "--trace", "azure-conv", "--num-requests", "60", "--slo-ttft",
               "0.7", "--slo-tpot", "0.06", "--find-goodput", "1:200", "--no-progress",
               "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "DistServe goodput:" in text
    data = json.loads(out.read_text())
    assert data["bound"] == "found" and 1 <= data["goodput"] < 200
    assert all(r["attainment"] >= 0.9 for r in data["runs"] if r["rate"] <= data["goodput"])


def test_simulate_find_goodput_needs_an_slo(capsys):
    rc = main(["simulate", "--num-requests", "10", "--find-goodput", "1:2", "--no-progress"])
    assert rc != 0
    assert "--find-goodput needs an SLO" in capsys.readouterr().err
