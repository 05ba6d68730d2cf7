"""Tenants in the simulator: --tenant-mix, per-tenant rows, Jain's index, rejected requests."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from kvloop.cli.main import main
from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.executor.simulated import CostModel, get_hardware_spec, get_model_spec
from kvloop.sim.driver import simulate, to_request
from kvloop.sim.metrics import (
    format_table,
    jain_index,
    request_service,
    summarize_requests,
    tenant_service_over_time,
)
from kvloop.sim.workloads import apply_tenant_mix, parse_tenant_mix, synthetic_workload


@dataclass
class FakeRequest:
    """The attributes metrics read (like kvloop.core.request.Request), plus a tenant."""

    arrival_time: float
    token_times: list[float] = field(default_factory=list)
    tenant: str = ""
    num_prompt_tokens: int = 10
    status: str = "FINISHED_STOPPED"
    first_scheduled_time: float | None = None

    def __post_init__(self) -> None:
        self.output_token_ids = list(range(len(self.token_times)))
        self.first_token_time = self.token_times[0] if self.token_times else None
        self.finished_time = self.token_times[-1] if self.token_times else self.arrival_time


def test_parse_tenant_mix():
    assert parse_tenant_mix("0.6, 0.2,0.2") == [0.6, 0.2, 0.2]
    assert parse_tenant_mix("3,1") == [3.0, 1.0]  # relative weights
    for bad, why in [("", "got ''"), ("0.6,x", "got 'x'"), ("0.5,-1", ">= 0"),
                     ("0,0", "not all be 0"), ("1,nan", ">= 0"), ("1,,2", "got ''"),
                     ("0:0.5", "got '0:0.5'")]:
        with pytest.raises(ValueError, match=f"bad tenant mix.*{why}"):
            parse_tenant_mix(bad)


def test_apply_tenant_mix_shares_and_seed():
    reqs = synthetic_workload(4000, request_rate=1.0, prompt_len=4, output_len=4)
    apply_tenant_mix(reqs, [0.6] + [0.05] * 8, seed=3)
    names = [r.tenant for r in reqs]
    assert set(names) == {f"t{i}" for i in range(9)}
    assert names.count("t0") / len(names) == pytest.approx(0.6, abs=0.03)
    again = synthetic_workload(4000, request_rate=1.0, prompt_len=4, output_len=4)
    apply_tenant_mix(again, [0.6] + [0.05] * 8, seed=3)
    assert [r.tenant for r in again] == names
    assert to_request(again[0]).tenant == names[0]
    # its own random stream: arrivals and lengths do not move
    assert [r.arrival_time for r in again] == [
        r.arrival_time for r in synthetic_workload(4000, request_rate=1.0, prompt_len=4,
                                                   output_len=4)]
    with pytest.raises(ValueError, match="bad tenant mix"):
        apply_tenant_mix(reqs, [0.0, 0.0])


def test_jain_index_hand_computed():
    assert jain_index([5, 5, 5, 5]) == 1.0
    assert jain_index([1, 0, 0, 0]) == 0.25
    # (1 + 2 + 3)^2 / (3 * (1 + 4 + 9)) = 36 / 42
    assert jain_index([1, 2, 3]) == pytest.approx(36 / 42)
    assert jain_index([]) is None and jain_index([0, 0]) is None


def _tenant_requests() -> list[FakeRequest]:
    return [
        # a: prompt 10 at t=1, outputs at 1, 2, 3; all before the last arrival (4.0)
        FakeRequest(0.0, [1.0, 2.0, 3.0], "a"),
        # a: prompt 10 at 4.5: after the last arrival, no service counted; ttft 0.5
        FakeRequest(4.0, [4.5, 4.6], "a"),
        # b: prompt 20 at 2, outputs at 2, 3.5 (counted) and 5 (not); ttft 1.0
        FakeRequest(1.0, [2.0, 3.5, 5.0], "b", num_prompt_tokens=20),
        # b: rejected by the slo policy: no first token, no service, never good
        FakeRequest(3.0, [], "b", status="FINISHED_REJECTED"),
    ]


def test_request_service_counts_tokens_until():
    req = _tenant_requests()[2]
    assert request_service(req) == 23
    assert request_service(req, until=4.0) == 22
    assert request_service(req, until=1.9) == 0


def test_per_tenant_rows_hand_computed():
    s = summarize_requests(_tenant_requests(), slo_ttft=0.9, tenant_weights={"b": 2.0})
    assert s["rejected"] == 1 and s["completed"] == 3
    assert s["duration"] == 5.0  # first arrival 0 to last token 5.0
    a, b = s["tenants"]["a"], s["tenants"]["b"]
    assert (a["requests"], a["completed"], a["rejected"]) == (2, 2, 0)
    assert (b["requests"], b["completed"], b["rejected"]) == (2, 1, 1)
    assert a["service_tokens"] == 13 and b["service_tokens"] == 22
    assert a["share"] == pytest.approx(13 / 35) and b["share"] == pytest.approx(22 / 35)
    # ttft: a 1.0 (misses 0.9) and 0.5 (meets); b 1.0 (misses)
    assert a["goodput"] == pytest.approx(1 / 5) and b["goodput"] == 0.0
    assert s["goodput"] == pytest.approx(1 / 5)
    assert a["ttft_mean"] == pytest.approx(0.75) and a["ttft_p99"] == pytest.approx(1.0)
    # weights: x = (13 / 1, 22 / 2) = (13, 11)
    assert s["jain_index"] == pytest.approx(24**2 / (2 * (13**2 + 11**2)))
    text = format_table(s)
    assert "Rejected requests (SLO)" in text and "Jain's fairness index" in text
    assert any(line.split()[:3] == ["b", "2", "22"] for line in text.splitlines())
    json.dumps(s)


def test_per_request_slo_overrides_default():
    reqs = _tenant_requests()
    reqs[0].slo_ttft = 2.0  # its own, looser target
    assert summarize_requests(reqs, slo_ttft=0.9)["tenants"]["a"]["goodput"] == 2 / 5


def test_no_tenants_no_rows():
    s = summarize_requests([FakeRequest(0.0, [1.0])])
    assert s["tenants"] == {} and s["jain_index"] is None
    assert "Tenants" not in format_table(s)


def test_service_over_time_bins():
    starts, series = tenant_service_over_time(_tenant_requests(), bin_s=2.0)
    assert starts == [0.0, 2.0, 4.0]
    # a: 10+1 at 1, 1 at 2, 1 at 3, 10+1 at 4.5, 1 at 4.6; b: 20+1 at 2, 1 at 3.5, 1 at 5
    assert series == {"a": [11, 2, 12], "b": [0, 22, 1]}


def _cost() -> CostModel:
    return CostModel(get_model_spec("llama-3.1-8b"), get_hardware_spec("h100"))


def test_simulate_takes_slos_from_scheduler_config():
    work = synthetic_workload(40, request_rate=20.0, prompt_len=256, output_len=16, seed=1)
    apply_tenant_mix(work, [0.5, 0.5], seed=1)
    sched = SchedulerConfig(max_model_len=4096, slo_ttft=1e-6, slo_tpot=1.0)
    result = simulate(work, sched, CacheConfig(num_gpu_blocks=500), _cost())
    m = result.metrics
    assert m["slo_ttft"] == 1e-6 and m["slo_tpot"] == 1.0 and m["goodput"] == 0.0
    assert set(m["tenants"]) == {"t0", "t1"}
    assert sum(row["requests"] for row in m["tenants"].values()) == 40
    assert 0 < m["jain_index"] <= 1


def test_cli_tenant_mix(tmp_path, capsys):
    out = tmp_path / "m.json"
    rc = main(["simulate", "--num-requests", "30", "--request-rate", "10", "--prompt-len",
               "64", "--output-len", "8", "--tenant-mix", "0.6,0.2,0.2", "--no-progress",
               "--num-gpu-blocks", "400", "--max-model-len", "1024", "--json", str(out)])
    assert rc == 0
    assert "Tenants" in capsys.readouterr().out
    m = json.loads(out.read_text())
    assert set(m["tenants"]) <= {"t0", "t1", "t2"} and m["jain_index"] is not None
    rc = main(["simulate", "--num-requests", "3", "--tenant-mix", "0.6,abc", "--no-progress"])
    assert rc == 2
    assert "bad tenant mix '0.6,abc'" in capsys.readouterr().err
