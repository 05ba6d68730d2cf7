"""Published metrics: DistServe SLO attainment, Andes QoE, VTC's backlogged service gap."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from kvloop.sim.metrics import format_table, summarize_requests
from kvloop.sim.published_metrics import (
    backlogged_intervals,
    qoe,
    slo_attainment,
    vtc_gap,
)


@dataclass
class Req:
    """The attributes the metrics read (like kvloop.core.request.Request)."""

    arrival_time: float
    token_times: list[float] = field(default_factory=list)
    tenant: str = ""
    num_prompt_tokens: int = 10
    status: str = "FINISHED_STOPPED"
    first_scheduled_time: float | None = None
    slo_ttft: float | None = None
    slo_tpot: float | None = None

    def __post_init__(self) -> None:
        self.output_token_ids = list(range(len(self.token_times)))
        self.first_token_time = self.token_times[0] if self.token_times else None
        self.finished_time = self.token_times[-1] if self.token_times else self.arrival_time


def test_slo_attainment_counts_rejected_as_missed():
    reqs = [
        Req(0.0, [0.5, 0.6, 0.7]),  # TTFT 0.5, TPOT 0.1: meets both
        Req(0.0, [2.0, 2.1]),  # TTFT 2.0: misses TTFT
        Req(0.0, [0.5, 1.5]),  # TPOT 1.0: misses TPOT
        Req(0.0, [], status="FINISHED_REJECTED"),
        Req(0.0, [], status="FINISHED_ABORTED"),  # not judged
    ]
    att = slo_attainment(reqs, 1.0, 0.2)
    assert att == {"judged": 4, "both": 0.25, "ttft": 0.5, "tpot": 0.5}
    assert slo_attainment(reqs, None, None)["both"] == 0.75
    assert slo_attainment([], 1.0, None)["both"] is None


def test_qoe_hand_computed():
    # Expected: first token at 1, then one per second; T = 3 (after two tokens are read).
    assert qoe([1.0, 2.0], 0.0, 1.0, 1.0) == 1.0
    assert qoe([0.1, 0.2], 0.0, 1.0, 1.0) == 1.0  # early tokens wait for the reader
    # Second token late by 0.5 s: areas (2 + 0.5) / (2 + 1).
    assert qoe([1.0, 2.5], 0.0, 1.0, 1.0) == pytest.approx(2.5 / 3)
    assert qoe([10.0, 11.0], 0.0, 1.0, 1.0) == 0.0
    assert qoe([], 0.0, 1.0, 1.0) == 0.0


def test_backlogged_intervals_merge():
    reqs = [Req(0.0, [2.0], tenant="a"), Req(1.0, [3.0], tenant="a"),
            Req(5.0, [6.0], tenant="a"), Req(0.0, [], tenant="b", status="RUNNING")]
    iv = backlogged_intervals(reqs, 9.0)
    assert iv == {"a": [[0.0, 3.0], [5.0, 6.0]], "b": [[0.0, 9.0]]}


def _two_tenants(ratio: int) -> list[Req]:
    """Tenants a and b, both waiting for the whole 0..20 s; a is served ``ratio`` times as
    many output tokens per second as b."""
    reqs = [Req(0.0, [20.0], tenant="a", num_prompt_tokens=1),
            Req(0.0, [20.0], tenant="b", num_prompt_tokens=1)]
    reqs.append(Req(0.0, [0.1 * i for i in range(1, 200)][::1], tenant="a",
                    num_prompt_tokens=1))
    reqs[-1].token_times = [0.1 * i / ratio * ratio for i in range(1, 200)]
    reqs.append(Req(0.0, [0.1 * ratio * i for i in range(1, 200 // ratio)], tenant="b",
                    num_prompt_tokens=1))
    return reqs


def test_vtc_gap_between_backlogged_tenants():
    fair = vtc_gap(_two_tenants(1), window_s=10.0)
    unfair = vtc_gap(_two_tenants(4), window_s=10.0)
    assert fair["windows"] == unfair["windows"] == 2
    assert fair["max_gap"] <= 2.0 and fair["jain_mean"] == pytest.approx(1.0, abs=1e-3)
    # a: 100 tokens x 2 per 10 s window; b: 25 x 2.
    assert unfair["max_gap"] == pytest.approx(150.0, abs=4.0)
    assert unfair["jain_mean"] < 0.75
    rates = {t: row["backlogged_rate"] for t, row in unfair["tenants"].items()}
    assert rates["a"] == pytest.approx(20.0, abs=0.5) and rates["b"] == pytest.approx(
        5.0, abs=0.5)
    weighted = vtc_gap(_two_tenants(4), window_s=10.0, tenant_weights={"a": 4.0})
    assert weighted["max_gap"] < 10.0
    with pytest.raises(ValueError, match="window_s"):
        vtc_gap(_two_tenants(1), window_s=0)


def test_summary_and_table_carry_published_metrics():
    s = summarize_requests(_two_tenants(4), slo_ttft=1.0, window_s=10.0)
    assert s["vtc"]["windows"] == 2 and s["tenants"]["a"]["backlogged_s"] == 20.0
    assert s["slo_attainment"]["both"] == 0.5 and 0 <= s["qoe"]["mean"] <= 1
    text = format_table(s)
    assert "VTC gap max, 10 s windows" in text and "SLO attainment" in text
    assert all(len(line) <= 50 for line in text.splitlines()
               if line.startswith(("VTC", "SLO", "QoE", "Jain, backlogged")))
    assert summarize_requests([Req(0.0, [1.0])])["vtc"] is None


def test_trace_summary_matches_the_run(tmp_path):
    from kvloop.cli.main import main

    run, summary, trace = (tmp_path / n for n in ("run.json", "summary.json", "t.jsonl"))
    common = ["--slo-ttft", "0.5", "--slo-tpot", "0.05"]
    assert main(["simulate", "--trace", "azure-conv", "--num-requests", "80", "--rate-scale",
                 "12", "--tenant-mix", "0.6,0.2,0.2", "--no-progress", "--trace-out",
                 str(trace), "--json", str(run), *common]) == 0
    assert main(["trace", "summary", str(trace), "--json", str(summary), *common]) == 0
    a, b = (json.loads(p.read_text()) for p in (run, summary))
    assert a["slo_attainment"] == b["slo_attainment"]
    assert a["qoe"]["mean"] == pytest.approx(b["qoe"]["mean"])
    assert a["vtc"]["windows"] == b["vtc"]["windows"]
