"""``kvloop trace view``: the page's server, and the command's errors (no browser)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvloop.cli import main
from kvloop.core import StepRecorder
from kvloop.viz.web.assets import ASSET_NAMES, asset, page
from kvloop.viz.web.trace_view import TraceViewServer
from web.traces import tight_pool_trace


@pytest.fixture(scope="module")
def served() -> Iterator[TraceViewServer]:
    server = TraceViewServer(tight_pool_trace(), "tight.jsonl", "127.0.0.1", 0)
    server.start()
    yield server
    server.shutdown()
    server.server_close()


def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_the_page_its_files_and_the_trace(served: TraceViewServer) -> None:
    status, headers, body = _get(served.url)
    assert status == 200 and b'content="trace"' in body
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    for name in ASSET_NAMES:
        assert _get(served.url + name)[0] == 200
    status, _, body = _get(served.url + "trace.json")
    doc = json.loads(body)
    assert doc["source"] == "tight.jsonl"
    assert doc["records"][1]["preempt_causes"] == [["C", "blocks", "A"]]
    assert doc["words"]["reasons"]["blocks"] == "no free KV blocks"
    status, _, body = _get(served.url + "nope")
    assert status == 404 and b"not found: /nope" in body


def test_assets_are_small_and_load_nothing_from_elsewhere() -> None:
    html = page("trace")
    files = [html] + [asset(name)[0] for name in ASSET_NAMES]  # type: ignore[index]
    assert sum(map(len, files)) < 1_000_000
    for text in files:
        assert b"http://" not in text and b"https://" not in text
    assert b"innerHTML" not in asset("app.js")[0]  # type: ignore[index]


def test_view_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "view", str(tmp_path / "missing.jsonl"), "--no-browser"]) == 2
    assert "trace file not found" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["trace", "view", str(empty), "--no-browser"]) == 2
    assert "error" in capsys.readouterr().err
    trace = tmp_path / "t.jsonl"
    rec = StepRecorder()
    rec.records = tight_pool_trace()
    rec.write_jsonl(str(trace))
    assert main(["trace", "view", str(trace), "--no-browser", "--port", "70000"]) == 2
    assert "--port must be 0-65535" in capsys.readouterr().err


def test_the_command_prints_its_url_and_serves(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rec = StepRecorder()
    rec.records = tight_pool_trace()
    rec.write_jsonl(str(trace))
    proc = subprocess.Popen([sys.executable, "-m", "kvloop.cli", "trace", "view", str(trace),
                             "--port", "0", "--no-browser"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(f"kvloop trace view: {len(rec.records)} steps from ")
        url = line.split(" at ", 1)[1].split()[0]
        status, _, body = _get(url + "trace.json")
        assert status == 200 and len(json.loads(body)["records"]) == len(rec.records)
    finally:
        proc.terminate()
        proc.wait(10)
