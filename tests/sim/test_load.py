"""Simulator honesty: utilisation, queue growth and the overload note (``kvloop.sim.load``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import pytest

from kvloop.cli import main
from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.executor.simulated import CostModel, get_hardware_spec, get_model_spec
from kvloop.sim.driver import simulate
from kvloop.sim.load import load_note, load_rows, load_summary
from kvloop.sim.workloads import synthetic_workload


@dataclass
class _Req:
    arrival_time: float
    first_scheduled_time: float
    finished_time: float
    status: str = "FINISHED_LENGTH"
    token_times: list[float] = field(default_factory=list)


def _fcfs_single_server(n: int, gap: float, service: float) -> list[_Req]:
    """One request at a time, arrivals every ``gap`` s, each served in ``service`` s."""
    reqs, free_at = [], 0.0
    for k in range(n):
        arrival = k * gap
        start = max(arrival, free_at)
        free_at = start + service
        reqs.append(_Req(arrival, start, free_at, token_times=[start + service / 2, free_at]))
    return reqs


def test_queue_growth_is_the_excess_of_arrivals_over_service():
    # Arrivals at 1 req/s, service at 0.5 req/s: the k-th request waits k seconds.
    reqs = _fcfs_single_server(40, gap=1.0, service=2.0)
    load = load_summary(reqs, busy_time=80.0, duration=80.0)
    assert load["arrival_rate"] == pytest.approx(1.0)
    assert load["queue_growth"] == pytest.approx(1.0) and load["overloaded"] is True
    assert load["excess"] == pytest.approx(1.0) and load["service_rate"] == pytest.approx(0.5)
    assert load["utilisation"] == pytest.approx(1.0)
    note = load_note(load)
    assert note is not None and note.startswith("overloaded: arrivals exceed service rate by 100%")
    assert "\n" not in note


def test_a_servable_load_has_no_note():
    reqs = _fcfs_single_server(40, gap=1.0, service=0.5)  # half busy, never a queue
    load = load_summary(reqs, busy_time=20.0, duration=40.0)
    assert load["overloaded"] is False and load["queue_growth"] == pytest.approx(0.0)
    assert load["excess"] is None and load_note(load) is None
    assert load_rows(load)["Engine busy (utilisation)"] == "50.0%"
    load["queue_growth"] = -1e-9
    assert load_rows(load)["Queue growth (s per s of arrivals)"] == "0.000"


def test_no_verdict_for_bursts_and_batches():
    # All at once: no arrival rate.
    batch = [_Req(0.0, 0.0, 1.0, token_times=[1.0]) for _ in range(20)]
    load = load_summary(batch, busy_time=1.0, duration=1.0)
    assert load["arrival_rate"] is None and load["overloaded"] is None
    assert load_rows(load)["Arrival rate (req/s)"] == "all at once"
    # A burst that one batch absorbs: queue times grow, but over a window much shorter than
    # a request's service and to far less than one: no verdict either.
    burst = [_Req(0.02 * k, 0.03 * k, 0.03 * k + 5.0, token_times=[0.03 * k + 5.0])
             for k in range(20)]
    load = load_summary(burst, busy_time=5.6, duration=5.6)
    assert load["queue_growth"] is None and load["overloaded"] is None
    # The same queue growth over a long enough window is overload.
    long = [_Req(1.0 * k, 1.5 * k, 1.5 * k + 5.0, token_times=[1.5 * k + 5.0])
            for k in range(20)]
    assert load_summary(long, busy_time=33.5, duration=33.5)["excess"] == pytest.approx(0.5)
    # Too few requests.
    few = _fcfs_single_server(5, gap=1.0, service=2.0)
    assert load_summary(few, busy_time=10.0, duration=10.0)["overloaded"] is None


def _simulate(rate: float, n: int = 300):
    wl = synthetic_workload(n, request_rate=rate, prompt_len="trace:sharegpt",
                            output_len="trace:sharegpt", seed=0)
    return simulate(wl, SchedulerConfig(max_model_len=8192, max_num_batched_tokens=8192),
                    CacheConfig(num_gpu_blocks=4000),
                    CostModel(get_model_spec("llama-3.1-8b"), get_hardware_spec("h100")))


def test_simulator_flags_overload_and_estimates_the_service_rate():
    heavy = _simulate(40.0).metrics
    load = heavy["load"]
    assert load["overloaded"] is True and load["excess"] > 1.0
    # The service rate estimate is close to what the run actually served.
    served = heavy["completed"] / heavy["duration"]
    assert load["service_rate"] == pytest.approx(served, rel=0.35)
    assert 0 < load["busy_time"] <= heavy["duration"] + 1e-9
    assert 0.9 <= load["utilisation"] <= 1.0 + 1e-9
    light = _simulate(1.0).metrics["load"]
    assert light["overloaded"] is False and abs(light["queue_growth"]) < 0.005


def test_cli_says_overloaded_only_when_it_is(tmp_path, capsys):
    base = ["simulate", "--num-requests", "300", "--no-progress", "--num-gpu-blocks", "4000"]
    out = tmp_path / "m.json"
    assert main([*base, "--request-rate", "40", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    lines = [line for line in text.splitlines() if line.startswith("overloaded:")]
    assert len(lines) == 1 and "arrivals exceed service rate by" in lines[0], text
    assert "Engine busy (utilisation)" in text and "Arrival rate (req/s)" in text
    assert json.loads(out.read_text())["load"]["overloaded"] is True
    assert main([*base, "--request-rate", "1"]) == 0
    text = capsys.readouterr().out
    assert "overloaded" not in text and "Queue growth" in text
    assert main([*base, "--num-requests", "50"]) == 0  # all at once
    text = capsys.readouterr().out
    assert "all at once" in text and "overloaded" not in text
    assert math.isfinite(json.loads(out.read_text())["load"]["arrival_rate"])


def test_no_rate_from_a_handful_of_arrivals_or_a_blink():
    pair = [_Req(0.0, 0.0, 1.0, token_times=[1.0]), _Req(1e-4, 1e-4, 1.0, token_times=[1.0])]
    load = load_summary(pair, busy_time=1.0, duration=1.0)
    assert load["arrival_rate"] is None  # not 10,000 req/s
    assert load_rows(load)["Arrival rate (req/s)"] == (
        "- (2 arrivals over 0.0001 s: too few for a rate)")
    blink = [_Req(0.01 * k, 0.01 * k, 1.0, token_times=[1.0]) for k in range(50)]
    assert load_summary(blink, busy_time=1.0, duration=1.0)["arrival_rate"] is None
    spread = [_Req(0.5 * k, 0.5 * k, 0.5 * k + 0.1, token_times=[0.5 * k + 0.1])
              for k in range(5)]
    assert load_summary(spread, busy_time=1.0, duration=2.1)["arrival_rate"] == (
        pytest.approx(2.0))
