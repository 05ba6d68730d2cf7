"""Memory under hostile input: a 50 MB body, declared or chunked, is refused (413) by a real
``kvloop serve`` process without its memory growing by more than a few MB; with the limit
off the same body shows up in full, so the measurement can see such growth."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serverkit import MODEL_NAME, serve_subprocess

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc/PID/status")

BODY_BYTES = 50_000_000
MAX_GROWTH = 6 * 2**20
"""A few MB: a refused body may cost the server a few buffers (uvicorn pauses reading at
64 KiB), never the body."""


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


class PeakRSS:
    """The peak resident memory of process ``pid`` while a block runs, in bytes.

    Resets the kernel's high-water mark (``/proc/PID/clear_refs``) when allowed and reads
    ``VmHWM`` after the block; also samples ``VmRSS`` every millisecond (the only source
    where the reset is not allowed)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
            hwm_reset = True
        except OSError:
            hwm_reset = False
        samples = [_status_kib(self.pid, "VmRSS")]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                samples.append(_status_kib(self.pid, "VmRSS"))
                time.sleep(0.001)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            yield
        finally:
            done.set()
            sampler.join()
        peak = max(samples)
        if hwm_reset:
            peak = max(peak, _status_kib(self.pid, "VmHWM"))
        self.peak = peak * 1024


def _pieces(total: int, size: int = 1 << 16) -> Iterator[bytes]:
    piece = b"x" * size
    for start in range(0, total, size):
        yield piece[:min(size, total - start)]


def _steady_rss(pid: int) -> int:
    """The server's resident memory once it settled (bytes)."""
    time.sleep(0.2)
    return _status_kib(pid, "VmRSS") * 1024


def _post_big(url: str, *, declared: bool) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    if declared:
        headers["Content-Length"] = str(BODY_BYTES)
    return httpx.post(f"{url}/v1/completions", content=_pieces(BODY_BYTES), headers=headers,
                      timeout=60)


def _warm_up(url: str) -> None:
    ok = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}
    for _ in range(3):
        assert httpx.post(f"{url}/v1/completions", json=ok, timeout=30).status_code == 200
        assert httpx.post(f"{url}/v1/completions", content=b"x" * (2 << 20),
                          timeout=30).status_code == 413


def test_refused_bodies_leave_memory_flat(tiny_model: Path) -> None:
    with serve_subprocess(tiny_model, "--max-request-bytes", str(1 << 20)) as srv:
        pid = srv.proc.pid
        _warm_up(srv.url)
        for declared in (True, False):
            base = _steady_rss(pid)
            rss = PeakRSS(pid)
            with rss.measure():
                r = _post_big(srv.url, declared=declared)
            assert r.status_code == 413, r.text
            assert r.json()["error"]["code"] == 413
            growth = rss.peak - base
            assert growth < MAX_GROWTH, (
                f"{'declared' if declared else 'chunked'} 50 MB body: the server grew by "
                f"{growth / 2**20:.1f} MB")
        # the server is fine afterwards
        ok = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}
        assert httpx.post(f"{srv.url}/v1/completions", json=ok, timeout=30).status_code == 200


def test_the_measurement_sees_a_body_that_is_read(tiny_model: Path) -> None:
    """The control: with no limit the server holds the whole body (and more) at once."""
    with serve_subprocess(tiny_model, "--max-request-bytes", "0") as srv:
        pid = srv.proc.pid
        _warm_up_unlimited(srv.url)
        base = _steady_rss(pid)
        rss = PeakRSS(pid)
        with rss.measure():
            r = _post_big(srv.url, declared=True)
        assert r.status_code == 400  # not JSON: read in full, then refused
        assert rss.peak - base > BODY_BYTES * 0.8


def _warm_up_unlimited(url: str) -> None:
    ok = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}
    r = httpx.post(f"{url}/v1/completions", json=ok, timeout=30)
    assert r.status_code == 200, r.text
