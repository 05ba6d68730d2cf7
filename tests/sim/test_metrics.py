"""Metrics over finished requests, checked against hand-computed values."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

import pytest

from kvloop.sim.metrics import format_table, percentile, summarize_requests


class Status(enum.Enum):
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7
    RUNNING = 1


@dataclass
class FakeRequest:
    """Just the attributes metrics read, like kvloop.core.request.Request."""

    arrival_time: float
    token_times: list[float] = field(default_factory=list)
    first_scheduled_time: float | None = None
    num_prompt_tokens: int = 10
    status: Status = Status.FINISHED_STOPPED
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0

    def __post_init__(self) -> None:
        self.output_token_ids = list(range(len(self.token_times)))
        self.first_token_time = self.token_times[0] if self.token_times else None
        self.finished_time = self.token_times[-1] if self.token_times else self.arrival_time


def _requests() -> list[FakeRequest]:
    return [
        # ttft 1.0, e2e 2.0, tpot 1/3, gaps 0.2 0.3 0.5, queue 0.5
        FakeRequest(0.0, [1.0, 1.2, 1.5, 2.0], 0.5, num_prompt_tokens=10, num_preemptions=2),
        # ttft 0.5, e2e 0.5, one token: no TPOT, no gaps; queue 0
        FakeRequest(1.0, [1.5], 1.0, num_prompt_tokens=20),
        # ttft 1.0, e2e 1.2, tpot 0.1, gaps 0.1 0.1, queue 0.5
        FakeRequest(2.0, [3.0, 3.1, 3.2], 2.5, num_prompt_tokens=5, status=Status.FINISHED_LENGTH),
        FakeRequest(0.5, [4.0, 9.0], 0.6, status=Status.FINISHED_ABORTED),
        FakeRequest(0.7, [], None, status=Status.FINISHED_ERROR),
    ]


def test_percentile_nearest_rank():
    values = list(range(1, 11))
    assert [percentile(values, q) for q in (0, 10, 50, 90, 91, 99, 100)] == [1, 1, 5, 9, 10, 10, 10]
    hundred = list(range(1, 101))
    assert [percentile(hundred, q) for q in (7, 29, 57, 99.5)] == [7, 29, 57, 100]
    assert percentile([3.0], 99) == 3.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_summary_hand_computed():
    s = summarize_requests(_requests())
    assert (s["completed"], s["aborted"], s["failed"], s["unfinished"]) == (3, 1, 1, 0)
    assert s["duration"] == pytest.approx(3.2)  # first arrival 0.0 -> last completion 3.2
    assert s["input_tokens"] == 35 and s["output_tokens"] == 8
    assert s["request_throughput"] == pytest.approx(3 / 3.2)
    assert s["output_throughput"] == pytest.approx(8 / 3.2)
    assert s["total_token_throughput"] == pytest.approx(43 / 3.2)
    assert s["goodput"] == s["request_throughput"]  # no SLO given
    assert s["preemptions"] == 2
    ttft, tpot, itl, e2e, queue = (s[k] for k in ("ttft", "tpot", "itl", "e2e", "queue"))
    assert ttft["count"] == 3 and ttft["mean"] == pytest.approx(2.5 / 3)
    assert (ttft["p50"], ttft["p90"], ttft["p99"]) == (1.0, 1.0, 1.0)
    # The one-token request has no TPOT.
    assert tpot["count"] == 2 and tpot["mean"] == pytest.approx((1 / 3 + 0.1) / 2)
    assert tpot["p50"] == pytest.approx(0.1) and tpot["p90"] == pytest.approx(1 / 3)
    # ITL over all five gaps of all requests: 0.1 0.1 0.2 0.3 0.5.
    assert itl["count"] == 5 and itl["mean"] == pytest.approx(0.24)
    assert itl["p50"] == pytest.approx(0.2) and itl["p90"] == pytest.approx(0.5)
    assert e2e["mean"] == pytest.approx((2.0 + 0.5 + 1.2) / 3) and e2e["p99"] == 2.0
    assert queue["p50"] == 0.5 and queue["mean"] == pytest.approx(1 / 3)
    json.dumps(s)  # JSON-ready


@pytest.mark.parametrize(
    ("slo_ttft", "slo_tpot", "good"),
    [
        (0.9, None, 1),  # only the one-token request has TTFT <= 0.9
        (None, 0.2, 2),  # TPOT 1/3 fails; the one-token request meets any TPOT SLO
        (0.9, 0.2, 1),
        (1.0, 0.5, 3),  # limits are inclusive
        (0.1, 0.01, 0),
    ],
)
def test_goodput(slo_ttft, slo_tpot, good):
    s = summarize_requests(_requests(), slo_ttft=slo_ttft, slo_tpot=slo_tpot)
    assert s["goodput"] == pytest.approx(good / 3.2)
    assert (s["slo_ttft"], s["slo_tpot"]) == (slo_ttft, slo_tpot)


def test_empty_and_unfinished():
    s = summarize_requests([])
    assert s["completed"] == 0 and s["duration"] == 0.0 and s["request_throughput"] is None
    assert s["ttft"] == {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    s = summarize_requests([FakeRequest(0.0, [1.0], 0.5, status=Status.RUNNING)])
    assert s["unfinished"] == 1 and s["completed"] == 0
    assert "Successful requests" in format_table(s)


def test_core_request_status_names():
    request = pytest.importorskip("kvloop.core.request")
    req = FakeRequest(0.0, [0.5, 1.0], 0.1)
    req.status = request.RequestStatus.FINISHED_LENGTH  # type: ignore[assignment]
    assert summarize_requests([req])["completed"] == 1


def test_format_table():
    s = summarize_requests(_requests(), slo_ttft=1.0)
    text = format_table(s, extra={"Prefix hit rate": 0.6512, "Preemptions": 2})
    lines = text.splitlines()
    assert lines[0].startswith("=") and "Serving Benchmark Result" in lines[0]
    assert any(line.startswith("Mean TTFT (ms):") and line.endswith("833.33") for line in lines)
    assert any(line.startswith("P99 ITL (ms):") and line.endswith("500.00") for line in lines)
    assert any("Request goodput (req/s):" in line for line in lines)
    assert any(line.startswith("Prefix hit rate:") and line.endswith("0.6512") for line in lines)
    assert "Aborted requests" in text and "Failed requests" in text
    assert max(len(line) for line in lines) <= 50
