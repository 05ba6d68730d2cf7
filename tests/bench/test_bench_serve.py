"""``kvloop bench serve`` against a live kvloop server with a tiny model (tests/server's kit)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from kvloop.bench import ServeBenchConfig, format_report, run_bench
from kvloop.bench.client import error_message
from kvloop.bench.prompts import PromptBuilder, load_tokenizer
from kvloop.cli import main
from server.serverkit import MODEL_NAME, LiveServer, build_tiny_model, free_port, start_server

OUTPUT_LEN = 12
INPUT_LEN = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("bench-tiny"))


@pytest.fixture(scope="module")
def live(tiny: Path) -> Iterator[LiveServer]:
    server = start_server(tiny)
    yield server
    server.stop()


def _config(live: LiveServer, tiny: Path, **overrides: Any) -> ServeBenchConfig:
    base = dict(base_url=live.url, num_prompts=6, random_input_len=INPUT_LEN,
                random_output_len=OUTPUT_LEN, ignore_eos=True, tokenizer=str(tiny),
                progress=False, seed=1)
    return ServeBenchConfig(**{**base, **overrides})


def _check_consistent(report: dict[str, Any], n: int) -> None:
    summary = report["summary"]
    assert summary["completed"] == n and summary["failed"] == 0 and not report["errors"]
    assert summary["output_tokens"] == n * OUTPUT_LEN
    for key in ("ttft", "tpot", "itl", "e2e"):
        stats = summary[key]
        assert stats["count"] > 0
        assert all(math.isfinite(stats[s]) and stats[s] >= 0 for s in ("mean", "p50", "p99"))
        assert stats["p50"] <= stats["p90"] <= stats["p99"]
    for name in ("request_throughput", "output_throughput", "total_token_throughput"):
        assert math.isfinite(summary[name]) and summary[name] > 0
    rows = report["requests"]
    assert len(rows) == n
    for row in rows:
        assert row["error"] is None and row["status"] == "FINISHED_LENGTH"
        assert row["output_tokens"] == row["expected_output_tokens"] == OUTPUT_LEN
        assert 0 <= row["ttft"] <= row["e2e"]
        assert all(gap >= 0 for gap in row["itl"])
        assert len(row["itl"]) == OUTPUT_LEN - 1
        assert abs(row["prompt_tokens"] - INPUT_LEN) <= 3


def test_high_rate(live: LiveServer, tiny: Path) -> None:
    report = run_bench(_config(live, tiny, request_rate=200.0, goodput={"ttft": 60.0}))
    _check_consistent(report, 6)
    assert report["model"] == MODEL_NAME  # the first of GET /v1/models
    assert report["summary"]["goodput"] == pytest.approx(
        report["summary"]["request_throughput"])  # a 60 s TTFT SLO is met by all
    assert "Serving Benchmark Result" in format_report(report)


def test_max_concurrency_chat(live: LiveServer, tiny: Path) -> None:
    report = run_bench(_config(live, tiny, max_concurrency=2, endpoint="chat"))
    summary = report["summary"]
    assert summary["completed"] == 6 and summary["output_tokens"] == 6 * OUTPUT_LEN
    sends = sorted(r["send_offset"] for r in report["requests"])
    ends = sorted(r["send_offset"] + r["e2e"] for r in report["requests"])
    assert sends[2] >= ends[0] - 1e-3  # the third request waited for a slot


def test_cli_writes_json(live: LiveServer, tiny: Path, tmp_path: Path,
                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--base-url", f"{live.url}/v1", "--model", MODEL_NAME,
               "--num-prompts", "4", "--request-rate", "inf", "--max-concurrency", "3",
               "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
               "--ignore-eos", "--tokenizer", str(tiny), "--goodput", "ttft:60000", "tpot:1000",
               "--no-progress", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Mean TTFT (ms)" in printed and "Request goodput" in printed
    report = json.loads(out.read_text())
    _check_consistent(report, 4)
    assert report["config"]["max_concurrency"] == 3
    assert report["summary"]["slo_tpot"] == pytest.approx(1.0)


def test_bad_model_fails_every_request(live: LiveServer, tiny: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    report = run_bench(_config(live, tiny, model="no-such-model", num_prompts=3))
    summary = report["summary"]
    assert summary["completed"] == 0 and summary["failed"] == 3
    assert report["errors"] == {"HTTP 404: The model `no-such-model` does not exist.": 3}
    assert all(r["error"] and r["ttft"] is None for r in report["requests"])
    assert "3 x HTTP 404" in format_report(report)
    rc = main(["bench", "serve", "--base-url", live.url, "--model", "nope", "--num-prompts",
               "2", "--tokenizer", str(tiny), "--no-progress"])
    assert rc == 1
    assert "2 x HTTP 404: The model `nope` does not exist." in capsys.readouterr().out


def test_usage_errors_exit_2(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["bench", "serve", "--base-url", url, "--tokenizer", str(tiny),
                 "--no-progress"]) == 2
    assert "cannot reach" in capsys.readouterr().err
    assert main(["bench", "serve", "--goodput", "e2el:5", "--no-progress"]) == 2
    assert main(["bench", "serve", "--num-prompts", "0", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("kvloop: error: ") for line in err)


def test_shared_prefix_blocks_and_lengths(tiny: Path) -> None:
    builder = PromptBuilder(load_tokenizer(str(tiny)), seed=0)
    for n in (1, 7, 40, 100):
        assert abs(builder.count(builder.text_for(range(1000, 1000 + n))) - n) <= 2
    block = builder.block_text(5, 512)
    assert block == builder.block_text(5, 512) != builder.block_text(6, 512)


def test_error_message_shapes() -> None:
    assert error_message(400, b'{"error": {"message": "bad"}}') == "HTTP 400: bad"
    assert error_message(422, b'{"detail": "nope"}') == "HTTP 422: nope"
    assert error_message(500, b"boom") == "HTTP 500: boom"


def test_payload_fields() -> None:
    from kvloop.bench.serve import _payload

    cfg = ServeBenchConfig(ignore_eos=True)
    body = _payload(cfg, "m", "hi", 7)
    assert body["prompt"] == "hi" and body["max_tokens"] == 7 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    plain = _payload(ServeBenchConfig(ignore_eos=True, extra_fields=False, min_tokens=True,
                                      endpoint="chat"), "m", "hi", 7)
    assert "ignore_eos" not in plain and plain["min_tokens"] == 7
    assert plain["messages"] == [{"role": "user", "content": "hi"}]


def test_progress_moves_before_the_first_request_finishes(
        live: LiveServer, tiny: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import re

    from kvloop.bench import progress

    monkeypatch.setattr(progress, "REFRESH_S", 0.0)  # draw every event
    report = run_bench(_config(live, tiny, num_prompts=3, progress=True))
    assert report["summary"]["completed"] == 3
    frames = re.split(r"[\r\n]", capsys.readouterr().err)
    counts = [(int(m[1]), int(m[2])) for f in frames
              if (m := re.search(r"\| (\d+)/\d+ .*done (\d+)", f))]
    assert any(tokens > 0 and done == 0 for tokens, done in counts), frames[:8]
    assert counts[-1] == (3 * OUTPUT_LEN, 3)


def test_tenant_mix_names_the_user_and_reports_per_tenant(live: LiveServer, tiny: Path) -> None:
    report = run_bench(_config(live, tiny, tenant_mix="0.5,0.5"))
    _check_consistent(report, 6)
    tenants = {row["tenant"] for row in report["requests"]}
    assert tenants <= {"t0", "t1"} and tenants
    summary = report["summary"]
    assert set(summary["tenants"]) == tenants
    assert sum(row["requests"] for row in summary["tenants"].values()) == 6
    # Jain's index counts service while requests still arrive (None if none was served then)
    assert summary["jain_index"] is None or 0 < summary["jain_index"] <= 1
    from kvloop.bench.serve import _payload

    assert _payload(ServeBenchConfig(), "m", "hi", 3, "t1")["user"] == "t1"
    with pytest.raises(ValueError, match="tenant mix"):
        ServeBenchConfig(tenant_mix="0.5,x").check()
