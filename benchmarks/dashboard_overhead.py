"""Engine throughput with a live ``/dashboard`` open, closed, and with no dashboard at all.

Two in-process servers of the same model (uvicorn on a thread, the engine on its own, as
``kvloop serve`` runs them): one as ``kvloop serve --no-dashboard`` (no step recorder), one
with the dashboard (its ``LiveRecorder`` keeps every step). Each round sends the same batch
of concurrent completions (``ignore_eos``, so every request generates ``--max-tokens``) to:

- ``no dashboard``: the server without a recorder;
- ``dashboard closed``: the dashboard server, nobody watching;
- ``dashboard open``: the dashboard server with one client reading ``/dashboard/events``
  (as a browser's ``EventSource`` does) for the whole batch.

Throughput is output tokens over the batch's wall time; the table gives the median over
rounds (variants interleaved within each round) and each variant against ``dashboard closed``,
and the process's CPU time per 1,000 output tokens (all threads: engine, HTTP, dashboard),
which a busy shared machine disturbs far less than wall time. Last, what an open dashboard
adds outside the engine thread: the time to encode a step's record as its events do, times
the steps the engine ran a second with it open: the share of one core (and of the GIL) the
event loop spends on it.

Run (from the repository root, with the project's virtual environment active)::

    python benchmarks/dashboard_overhead.py                       # default model, 3 rounds
    python benchmarks/dashboard_overhead.py --requests 16 --max-tokens 64 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import threading
import time
from typing import Any

import httpx
import uvicorn

from kvloop.engine.args import EngineArgs
from kvloop.engine.llm_engine import LLMEngine
from kvloop.server.app import ServerConfig, create_app
from kvloop.server.async_engine import AsyncEngine
from kvloop.server.dashboard import LiveRecorder, install_dashboard
from kvloop.server.metrics import ServerMetrics
from kvloop.viz.web.live import dashboard_parts

PROMPT = "Explain how a paged KV cache lets a server batch many requests at once. " * 4


def start(model: str, recorder: LiveRecorder | None
          ) -> tuple[str, uvicorn.Server, threading.Thread]:
    engine = LLMEngine.from_args(EngineArgs(model=model), recorder=recorder)
    metrics = ServerMetrics(model)
    aengine = AsyncEngine(engine, metrics=metrics)
    app = create_app(aengine, metrics, ServerConfig(model, model, None, 0))
    if recorder is not None:
        install_dashboard(app, recorder, **dashboard_parts(), api_key=None, source="bench",
                          engine=aengine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return f"http://127.0.0.1:{port}", server, thread


def batch(url: str, model: str, n: int, max_tokens: int) -> tuple[float, float]:
    """Output tokens per second of ``n`` concurrent completions, and CPU seconds of this
    process per 1,000 output tokens."""
    tokens = [0] * n

    def one(i: int) -> None:
        r = httpx.post(f"{url}/v1/completions", timeout=600, json={
            "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0})
        r.raise_for_status()
        tokens[i] = r.json()["usage"]["completion_tokens"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0, c0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return sum(tokens) / wall, 1000 * cpu / sum(tokens)


class Watcher:
    """One dashboard client reading events until stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.events = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.stream("GET", f"{self.url}/dashboard/events", timeout=None) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events += 1
                if self.stop.is_set():
                    return

    def __enter__(self) -> Watcher:
        self.thread.start()
        while not self.events:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    recorder = LiveRecorder()
    plain, s1, t1 = start(args.model, None)
    live, s2, t2 = start(args.model, recorder)
    for url in (plain, live):  # warm-up
        batch(url, args.model, args.requests, 8)
    results: dict[str, list[tuple[float, float]]] = {
        "no dashboard": [], "dashboard closed": [], "dashboard open": []}
    events = steps = 0
    open_s = 0.0
    for _ in range(args.rounds):
        results["no dashboard"].append(batch(plain, args.model, args.requests, args.max_tokens))
        results["dashboard closed"].append(
            batch(live, args.model, args.requests, args.max_tokens))
        with Watcher(live) as w:
            before, t0 = recorder.since(0, 0)[1], time.perf_counter()
            results["dashboard open"].append(
                batch(live, args.model, args.requests, args.max_tokens))
            steps += recorder.since(0, 0)[1] - before
            open_s += time.perf_counter() - t0
            events += w.events
    for server in (s1, s2):
        server.should_exit = True
    t1.join(10)
    t2.join(10)
    print(f"kvloop dashboard overhead: {args.model}, {args.requests} concurrent completions x "
          f"{args.max_tokens} tokens, {args.rounds} rounds, {platform.processor() or 'cpu'}, "
          f"Python {platform.python_version()}")
    base = statistics.median(r[0] for r in results["dashboard closed"])
    base_cpu = statistics.median(r[1] for r in results["dashboard closed"])
    print(f"{'variant':<18} {'tok/s median':>13} {'min':>8} {'max':>8} {'vs closed':>10} "
          f"{'CPU s/1k tok':>13} {'vs closed':>10}")
    for name, values in results.items():
        med = statistics.median(r[0] for r in values)
        cpu = statistics.median(r[1] for r in values)
        print(f"{name:<18} {med:>13.1f} {min(r[0] for r in values):>8.1f} "
              f"{max(r[0] for r in values):>8.1f} {med / base:>9.3f}x {cpu:>13.2f} "
              f"{cpu / base_cpu:>9.3f}x")
    print(f"dashboard events received while open: {events} "
          f"({events / args.rounds:.0f} a batch)")
    records = recorder.since(0, 300)[0]
    t0 = time.perf_counter()
    for _ in range(5):
        json.dumps({"records": [r.to_dict() for r in records]}, separators=(",", ":"))
    per_step = (time.perf_counter() - t0) / (5 * len(records))
    rate = steps / open_s
    print(f"encoding a step for the events: {per_step * 1e6:.0f} us; the engine ran "
          f"{rate:.1f} steps/s with a dashboard open: {100 * per_step * rate:.2f}% of one core")


if __name__ == "__main__":
    main()
