"""Hostile clients against ``kvloop serve``: what a misbehaving client costs everyone else.

Starts ``kvloop serve --model MODEL`` as a subprocess and runs three probes, each printing
its figures next to their targets:

* ``prompts``: ``/health`` latency (polled every 50 ms: p50, p99, max) and the inter-token
  gaps of a 600-token stream (``--stream-tokens``; median and max), first alone, then while
  ``--clients`` clients send 600 KB prompts back to back (``--pause`` seconds between an
  answer and the next request; the clients run in a process of their own at the lowest CPU
  priority, standing for other machines): ``words`` (``"w1 " * 200000``, refused by its
  words before it is encoded) and ``letters`` (600,000 random letters without a space: under
  the character bound, so it is encoded in full, then refused). Targets: ``/health`` p99
  <= 100 ms, stream max gap <= 3x its max alone.
* ``connections``: ``--slow`` connections that send their headers one byte a second and as
  many that send a declared body one byte a second: seconds until the server closes each
  (target: within the configured ``--header-timeout`` / ``--body-timeout``, here 10 and 30
  s); a 64 MB header: its status, the seconds to it, and the server's peak RSS growth.
* ``signals``: ``--signals`` times, a fresh server streams one request to ``[DONE]`` and
  gets SIGTERM at once: the drain must start (its log line) and the process exit 0.

    python benchmarks/hostile_clients.py [--model default] [--probes prompts connections
        signals] [--clients 16] [--slow 20] [--signals 20] [--json PATH]
        [-- more kvloop serve flags]

Not a CI test: it runs for minutes. Name the CPU (printed first) next to any figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import platform
import random
import signal
import socket
import statistics
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

HEALTH_EVERY_S = 0.05
SERVE_FLAGS: list[str] = []
"""More ``kvloop serve`` flags (the command line's, after ``--``)."""
NEVER_S = 60.0
"""A slow connection still open after this long is reported as never closed (inf)."""


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(model: str) -> Iterator[tuple[str, subprocess.Popen]]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvloop.cli", "serve", "--model", model, "--port", str(port),
         "--log-interval", "0", "--disable-uvicorn-access-log", *SERVE_FLAGS],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvloop serve exited: {proc.stdout.read()}")  # type: ignore
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("kvloop serve did not come up")
            time.sleep(0.1)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * len(s) + 0.5) - 1))] if s else float("nan")


# -- prompts ---------------------------------------------------------------------------------
async def _stream_gaps(http: httpx.AsyncClient, tokens: int) -> list[float]:
    body = {"prompt": "Tell me a long story.", "max_tokens": tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}
    times = []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
    return [b - a for a, b in itertools.pairwise(times)]


async def _poll_health(http: httpx.AsyncClient, stop: asyncio.Event) -> list[float]:
    latencies = []
    while not stop.is_set():
        t0 = time.monotonic()
        r = await http.get("/health")
        latencies.append(time.monotonic() - t0)
        assert r.status_code == 200, r.text
        await asyncio.sleep(HEALTH_EVERY_S)
    return latencies


async def _attack(url: str, text: str, clients: int, pause: float, stop_file: str) -> None:
    body = json.dumps({"prompt": text, "max_tokens": 4})
    statuses: dict[str, int] = {}
    stop = Path(stop_file)

    async def client(http: httpx.AsyncClient) -> None:
        while not stop.exists():
            try:
                r = await http.post("/v1/completions", content=body,
                                    headers={"content-type": "application/json"})
                key = str(r.status_code)
            except httpx.HTTPError as exc:
                key = type(exc).__name__
            statuses[key] = statuses.get(key, 0) + 1
            await asyncio.sleep(pause)

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    print(json.dumps(statuses), flush=True)


def _attackers(url: str, text: str, clients: int, pause: float, stop_file: Path
               ) -> subprocess.Popen:
    """The prompt clients, in a process of their own at the lowest CPU priority: they stand
    for other machines, so they take only the CPU the server leaves."""
    code = ("import asyncio, os, sys; os.nice(19); sys.path.insert(0, sys.argv[1]); "
            "import hostile_clients as h; "
            "asyncio.run(h._attack(sys.argv[2], sys.stdin.read(), int(sys.argv[3]), "
            "float(sys.argv[4]), sys.argv[5]))")
    proc = subprocess.Popen([sys.executable, "-c", code, str(Path(__file__).parent), url,
                             str(clients), str(pause), str(stop_file)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None
    proc.stdin.write(text)
    proc.stdin.close()
    return proc


async def _phase(url: str, text: str | None, clients: int, pause: float, tokens: int
                 ) -> dict[str, Any]:
    stop_file = Path(tempfile.mkdtemp()) / "stop"
    attack = _attackers(url, text, clients, pause, stop_file) if text is not None else None
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            await asyncio.sleep(2.0 if attack else 0)
            stop = asyncio.Event()
            health = asyncio.create_task(_poll_health(http, stop))
            gaps = await _stream_gaps(http, tokens)
            stop.set()
            latencies = await health
    finally:
        statuses = {}
        stop_file.touch()
        if attack is not None:
            out = attack.stdout.read() if attack.stdout else ""
            attack.wait(60)
            statuses = json.loads(out.strip().splitlines()[-1]) if out.strip() else {
                "attack process": f"exit {attack.returncode}"}
            if attack.poll() is None:
                attack.kill()
    return {"health_p50_ms": 1e3 * pct(latencies, 0.5),
            "health_p99_ms": 1e3 * pct(latencies, 0.99), "health_max_ms": 1e3 * max(latencies),
            "itl_median_ms": 1e3 * statistics.median(gaps), "itl_max_ms": 1e3 * max(gaps),
            "attack_statuses": statuses}


def probe_prompts(model: str, clients: int, pause: float, tokens: int) -> dict[str, Any]:
    rng = random.Random(0)
    texts = {"alone": None, "words": "w1 " * 200_000,
             "letters": "".join(rng.choice(string.ascii_letters) for _ in range(600_000))}
    out: dict[str, Any] = {}
    with serve(model) as (url, _):
        asyncio.run(_phase(url, None, 0, pause, tokens))  # warm-up
        for name, text in texts.items():
            out[name] = asyncio.run(_phase(url, text, clients, pause, tokens))
    alone = out["alone"]["itl_max_ms"]
    print(f"\nprompts: {clients} clients sending 600 KB prompts (each waits {pause:g} s after "
          f"an answer) during one {tokens}-token stream")
    print(f"{'phase':8} {'health p50':>10} {'p99':>8} {'max':>8} {'ITL med':>8} {'ITL max':>8} "
          f"{'max/alone':>9}  attack answers")
    for name, r in out.items():
        print(f"{name:8} {r['health_p50_ms']:8.1f}ms {r['health_p99_ms']:6.1f}ms "
              f"{r['health_max_ms']:6.1f}ms {r['itl_median_ms']:6.1f}ms {r['itl_max_ms']:6.1f}ms "
              f"{r['itl_max_ms'] / alone:8.2f}x  {r['attack_statuses']}")
    print("targets: health p99 <= 100 ms, ITL max <= 3x alone")
    return out


# -- connections -----------------------------------------------------------------------------
async def _slow(url: str, body: bool) -> float:
    """Seconds until the server closes a connection that sends its headers (or, with
    ``body``, its declared body) one byte a second."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    start = time.monotonic()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-length: 1000\r\n\r\n"
    payload = b"{" + b" " * 999 if body else head
    if body:
        writer.write(head)

    async def until_eof() -> None:
        with contextlib.suppress(OSError):
            while await reader.read(65536):
                pass

    closed = asyncio.create_task(until_eof())
    for i in range(len(payload)):
        if closed.done() or time.monotonic() - start > NEVER_S:
            break
        try:
            writer.write(payload[i:i + 1])
            await writer.drain()
        except OSError:
            break
        await asyncio.wait({closed}, timeout=1.0)
    done, _ = await asyncio.wait({closed}, timeout=NEVER_S - (time.monotonic() - start))
    writer.close()
    return time.monotonic() - start if done else float("inf")


def _giant_header(url: str) -> tuple[int | None, float]:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    start = time.monotonic()
    with contextlib.suppress(OSError):
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (64 << 20))
    raw = b""
    with contextlib.suppress(OSError):
        while data := sock.recv(65536):
            raw += data
            if b"\r\n\r\n" in raw:
                break
    took = time.monotonic() - start
    sock.close()
    status = int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/") else None
    return status, took


def probe_connections(model: str, slow: int) -> dict[str, Any]:
    with serve(model) as (url, proc):
        rss0 = peak_rss_mb(proc.pid)
        status, took = _giant_header(url)
        rss1 = peak_rss_mb(proc.pid)

        async def run() -> tuple[list[float], list[float]]:
            heads = [asyncio.create_task(_slow(url, False)) for _ in range(slow)]
            bodies = [asyncio.create_task(_slow(url, True)) for _ in range(slow)]
            return await asyncio.gather(*heads), await asyncio.gather(*bodies)

        heads, bodies = asyncio.run(run())
    out = {"giant_header_status": status, "giant_header_s": took,
           "peak_rss_growth_mb": rss1 - rss0, "slow_header_closed_s": heads,
           "slow_body_closed_s": bodies}
    print(f"\nconnections: a 64 MB header got {status} in {took:.2f} s (peak RSS +"
          f"{rss1 - rss0:.0f} MB); {slow} slow-header connections closed after "
          f"{min(heads):.1f}-{max(heads):.1f} s (target <= 10 s + 1), {slow} slow-body "
          f"after {min(bodies):.1f}-{max(bodies):.1f} s (target <= 30 s + 1)")
    return out


# -- signals ---------------------------------------------------------------------------------
def probe_signals(model: str, trials: int) -> dict[str, Any]:
    lost = 0
    for i in range(trials):
        with serve(model) as (url, proc):
            body = {"prompt": "hello", "max_tokens": 8, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        break
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(10)
            except subprocess.TimeoutExpired:
                rc = None
            log = proc.stdout.read() if rc is not None and proc.stdout else ""
            ok = rc == 0 and "draining" in log
            lost += not ok
            print(f"  signal {i + 1}/{trials}: {'drained' if ok else 'LOST'}", flush=True)
    print(f"\nsignals: {lost} of {trials} SIGTERMs at the idle edge lost (target 0)")
    return {"trials": trials, "lost": lost}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--probes", nargs="+", default=["prompts", "connections", "signals"],
                   choices=["prompts", "connections", "signals"])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--stream-tokens", type=int, default=600,
                   help="tokens of the stream whose gaps are measured")
    p.add_argument("--pause", type=float, default=0.0,
                   help="seconds each prompt client waits after an answer (0: back to back)")
    p.add_argument("--slow", type=int, default=20)
    p.add_argument("--signals", type=int, default=20)
    p.add_argument("--json", default=None)
    p.add_argument("serve_flags", nargs="*", help="after --: more kvloop serve flags")
    args = p.parse_args()
    SERVE_FLAGS.extend(args.serve_flags)
    print(f"CPU: {cpu_name()}; {time.strftime('%Y-%m-%d %H:%M')}; model {args.model}")
    results: dict[str, Any] = {"cpu": cpu_name(), "model": args.model}
    if "prompts" in args.probes:
        results["prompts"] = probe_prompts(args.model, args.clients, args.pause,
                                           args.stream_tokens)
    if "connections" in args.probes:
        results["connections"] = probe_connections(args.model, args.slow)
    if "signals" in args.probes:
        results["signals"] = probe_signals(args.model, args.signals)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
