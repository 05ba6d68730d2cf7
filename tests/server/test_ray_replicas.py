"""``kvloop serve --replicas 2`` on a local Ray: the official ``openai`` client
against two replicas of the tiny model, routing by prefix under ``kv-aware``, ``/metrics``
labelled by replica, and a clean shutdown that leaves no Ray process behind.

Slow-ish (a Ray start and two engines, ~30 s on 2 cores): marked ``ray`` so it can be
deselected with ``-m 'not ray'``; CI runs it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from serverkit import MODEL_NAME, free_port  # noqa: E402

pytestmark = pytest.mark.ray

API_KEY = "sk-test"
STARTUP_S = 240


def _ray_pids() -> set[int]:
    """Processes of any Ray (raylet, GCS, workers, Serve actors) on this machine."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"ray::" in cmd or b"/ray/" in cmd or b"raylet" in cmd or b"gcs_server" in cmd:
            pids.add(int(entry.name))
    return pids


class Cluster:
    def __init__(self, proc: subprocess.Popen, url: str, before: set[int]) -> None:
        self.proc, self.url, self.before = proc, url, before
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0,
                                    timeout=60)

    def per_replica(self, name: str) -> dict[str, float]:
        """``name``'s value on each replica (summed over its other labels)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name:
                    rid = s.labels["replica"]
                    out[rid] = out.get(rid, 0.0) + s.value
        return out


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    before = _ray_pids()
    port = free_port()
    log = (tmp_path_factory.mktemp("ray") / "serve.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvloop.cli", "serve", "--model", str(tiny_model),
         "--served-model-name", MODEL_NAME, "--port", str(port), "--api-key", API_KEY,
         "--replicas", "2", "--router", "kv-aware", "--threads-per-replica", "1",
         "--num-gpu-blocks", "64", "--max-model-len", "256"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_S
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.seek(0)
            pytest.fail(f"kvloop serve --replicas 2 did not come up:\n{log.read()[-4000:]}")
        time.sleep(0.5)
    live = Cluster(proc, url, before)
    # NOTE: the ingress's router learns its replicas from Ray by long poll, after the app
    # reports ready; until it knows both, it routes everything to the one it knows (seen in
    # CI: one replica in /metrics, all four kv-aware requests on it). Its first request
    # creates that router; wait until it routes to both.
    try:
        while len(live.per_replica("kvloop:num_requests_running")) < 2:
            live.client.completions.create(model=MODEL_NAME, prompt="warm", max_tokens=1)
            if time.monotonic() > deadline:
                pytest.fail("the ingress never routed to both replicas")
            time.sleep(0.2)
        yield live
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_completions_chat_and_streaming_through_replicas(cluster: Cluster) -> None:
    c = cluster.client
    done = c.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=5,
                                temperature=0, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 5 and done.choices[0].finish_reason == "length"
    chat = c.chat.completions.create(model=MODEL_NAME, max_tokens=4, temperature=0,
                                     messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    chunks = list(c.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=6,
                                       stream=True, temperature=0,
                                       extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_errors_are_the_single_servers(cluster: Cluster) -> None:
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        cluster.client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        cluster.client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    no_key = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        no_key.models.list()


def _served_by(cluster: Cluster, prompt: str) -> str:
    """The replica that served ``prompt`` (by its success counter)."""
    before = cluster.per_replica("kvloop:request_success_total")
    cluster.client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1,
                                      temperature=0)
    after = cluster.per_replica("kvloop:request_success_total")
    (who,) = [r for r in after if after[r] > before.get(r, 0.0)]
    return who


def test_kv_aware_spreads_new_prefixes_and_follows_a_cached_one(cluster: Cluster) -> None:
    # Prompts of a few distinct blocks each: idle replicas tie on load, so each goes to the
    # replica believed to cache the least, and they spread over both. (A router that never
    # learned where prompts went would send every one to the same replica.)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi"
    spread = {_served_by(cluster, f"{i} " + " ".join([words] * 2)) for i in range(6)}
    assert len(spread) == 2, spread
    # A shared prefix: the second request goes where the first went, and finds it cached.
    shared = " ".join(["the quick brown fox jumps over the lazy dog"] * 8)
    hits_before = cluster.per_replica("kvloop:prefix_cache_hits_total")
    holder = _served_by(cluster, shared + " one")
    # NOTE: past one stats period, so the holder's load reads 0 even if Ray has not yet
    # reported the first request complete (a load of 1 would tie its score with the idle
    # replica's, and ties go to the less loaded).
    time.sleep(1.5)
    assert _served_by(cluster, shared + " two") == holder
    hits = cluster.per_replica("kvloop:prefix_cache_hits_total")
    gained = {r: hits[r] - hits_before.get(r, 0.0) for r in hits}
    assert gained[holder] >= 48 and sum(gained.values()) == gained[holder], gained


def test_metrics_carry_one_series_per_replica(cluster: Cluster) -> None:
    running = cluster.per_replica("kvloop:num_requests_running")
    assert len(running) == 2


def test_shutdown_drains_then_leaves_no_ray_process(cluster: Cluster) -> None:
    stream = cluster.client.completions.create(
        model=MODEL_NAME, prompt="hello", max_tokens=200, stream=True, temperature=0,
        extra_body={"ignore_eos": True})
    first = next(iter(stream))  # the request runs on a replica
    cluster.proc.send_signal(signal.SIGTERM)
    rest = list(stream)  # NOTE: drained: it runs to its end, not cut off
    assert first.choices and rest[-1].choices[0].finish_reason == "length"
    assert cluster.proc.wait(timeout=90) == 0
    deadline = time.monotonic() + 30
    while (stray := _ray_pids() - cluster.before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not stray, f"Ray processes left behind: {sorted(stray)}"
