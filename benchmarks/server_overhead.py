"""The server's own cost: TTFT and ITL seen by HTTP clients vs what the engine recorded.

Starts ``kvloop serve --model default`` (a subprocess, ``--trace-out`` to a temporary JSONL),
warms it up, then runs ``--clients`` concurrent streaming clients (httpx, SSE) with fixed
prompts and ``--max-tokens`` (``ignore_eos``, greedy). Each client timestamps its request's
send and every chunk it receives; the server's step trace gives the engine's own timestamps
for the very same requests (matched by the completion id, which is the engine's request id):
TTFT from the arrival the HTTP handler recorded to the step that sampled the first token,
ITL between the steps that sampled consecutive tokens. Medians are nearest-rank over the
same requests (``kvloop.sim.metrics``), printed side by side with their ratio.

    python benchmarks/server_overhead.py [--clients 16] [--max-tokens 64] [--rounds 2]
        [--device cpu] [--json PATH] [-- extra kvloop serve flags]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvloop.sim.metrics import percentile, summarize_requests
from kvloop.viz.summary import load_records, reconstruct_requests

TOPICS = ["the ocean", "a bicycle", "volcanoes", "the moon", "bread", "jazz", "chess",
          "rainforests", "trains", "honey bees", "glaciers", "the printing press",
          "lighthouses", "coffee", "whales", "origami", "deserts", "kites", "comets", "tea"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, trace: Path, device: str | None, extra: list[str]
                 ) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvloop.cli", "serve", "--model", "default", "--port",
           str(port), "--trace-out", str(trace), "--log-interval", "0",
           "--disable-uvicorn-access-log", *(["--device", device] if device else []), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 900  # a first run converts the GGUF once
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"kvloop serve exited {proc.returncode}:\n{proc.stderr.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("kvloop serve did not come up")
        time.sleep(0.25)


Events = list[tuple[float, str]]
"""(arrival time, SSE data) of every event of one response."""


class RawConnection:
    """A lean keep-alive HTTP/1.1 client for one connection: the request bytes are written
    at the timestamped moment and each SSE event is timestamped as its chunk is read, with
    next to no client-side Python in between (httpx's own cost shows in ``--client httpx``)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, host: str, port: int) -> RawConnection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer, f"{host}:{port}")

    async def post_stream(self, path: str, body: bytes) -> tuple[float, Events]:
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        sent = time.monotonic()
        self.writer.write(head + body)
        status = await self.reader.readuntil(b"\r\n\r\n")
        if b" 200 " not in status.split(b"\r\n", 1)[0]:
            raise RuntimeError(status.decode(errors="replace"))
        events: Events = []
        buf = b""
        while True:  # chunked transfer encoding, one SSE event per chunk (or several)
            size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
            data = await self.reader.readexactly(size + 2)
            now = time.monotonic()
            if size == 0:
                return sent, events
            buf += data[:-2]
            *done, buf = buf.split(b"\n\n")
            events += [(now, e.decode()[6:]) for e in done if e.startswith(b"data: ")]

    def close(self) -> None:
        self.writer.close()


async def httpx_stream(http: httpx.AsyncClient, path: str, body: bytes
                       ) -> tuple[float, Events]:
    events: Events = []
    sent = time.monotonic()  # replaced by the send hook's time, just before the write
    async with http.stream("POST", path, content=body,
                           headers={"content-type": "application/json"}) as r:
        sent = r.request.extensions.get("sent_at", sent)
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append((time.monotonic(), line[6:]))
    return sent, events


def timings(sent: float, events: Events) -> dict:
    """The request id, the send time and the arrival of each token chunk."""
    rid, times = None, []
    for now, data in events:
        if data == "[DONE]":
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(chunk["error"]["message"])
        rid = chunk["id"]
        if chunk["choices"]:  # one chunk per step that sampled a token (text may be "")
            times.append(now)
    return {"id": rid, "sent": sent, "times": times, "ttft": times[0] - sent,
            "itl": [b - a for a, b in itertools.pairwise(times)]}


async def run_rounds(host: str, port: int, n: int, max_tokens: int, rounds: int,
                     client: str) -> list[dict]:
    """A warm-up round (8 tokens), then ``rounds`` rounds of ``n`` concurrent clients.

    NOTE: the connections stay open across rounds, as an OpenAI client keeps its own: the
    TCP handshakes happen in the warm-up, not inside the measured TTFT.
    """

    async def stamp(request: httpx.Request) -> None:
        request.extensions["sent_at"] = time.monotonic()

    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    http = httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=600, limits=limits,
                             event_hooks={"request": [stamp]})
    conns = [await RawConnection.open(host, port) for _ in range(n)] if client == "raw" else []

    async def one(i: int, prompt: str, tokens: int) -> dict:
        body = json.dumps({"model": "default", "prompt": prompt, "max_tokens": tokens,
                           "stream": True, "temperature": 0.0, "ignore_eos": True}).encode()
        if conns:
            return timings(*await conns[i].post_stream("/v1/completions", body))
        return timings(*await httpx_stream(http, "/v1/completions", body))

    async def round_(tokens: int, offset: int) -> list[dict]:
        prompts = [f"Write a short paragraph about {TOPICS[(i + offset) % len(TOPICS)]} "
                   f"(note {i + offset})." for i in range(n)]
        return await asyncio.gather(*(one(i, p, tokens) for i, p in enumerate(prompts)))

    try:
        await round_(8, 100)
        results = []
        for i in range(rounds):
            t = time.monotonic()
            results += await round_(max_tokens, i * n)
            print(f"round {i + 1}: {n} clients x {max_tokens} tokens in "
                  f"{time.monotonic() - t:.1f} s", flush=True)
        return results
    finally:
        for c in conns:
            c.close()
        await http.aclose()


def median(values: list[float]) -> float:
    return percentile(sorted(values), 50) if values else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default=None)
    ap.add_argument("--client", choices=["raw", "httpx"], default="raw",
                    help="raw: a lean asyncio HTTP/1.1 client (default); httpx: httpx streams")
    ap.add_argument("--json", default=None, help="save the figures as JSON")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="after --: kvloop serve flags")
    a = ap.parse_args()
    extra = [x for x in a.extra if x != "--"]
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "steps.jsonl"
        t0 = time.monotonic()
        proc = start_server(port, trace, a.device, extra)
        print(f"server up in {time.monotonic() - t0:.1f} s; warming up", flush=True)
        try:
            results = asyncio.run(run_rounds("127.0.0.1", port, a.clients, a.max_tokens,
                                             a.rounds, a.client))
        finally:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(120)
        if rc != 0:
            print(f"warning: server exited {rc}", file=sys.stderr)
        reqs = reconstruct_requests(load_records(str(trace)))
    ids = {r["id"] for r in results}
    engine = summarize_requests([reqs[i] for i in ids if i in reqs])
    client_ttft = median([r["ttft"] for r in results])
    client_itl = median([g for r in results for g in r["itl"]])
    eng_ttft, eng_itl = engine["ttft"]["p50"], engine["itl"]["p50"]
    rows = {
        "ttft_p50_s": (client_ttft, eng_ttft),
        "itl_p50_s": (client_itl, eng_itl),
    }
    # NOTE: time.monotonic is one clock for every process of a machine (CLOCK_MONOTONIC on
    # Linux), so the client's and the engine's timestamps compare directly.
    matched = [(r, reqs[r["id"]]) for r in results if r["id"] in reqs]
    send_to_arrival = median([q.arrival_time - r["sent"] for r, q in matched])
    token_to_client = median([r["times"][0] - q.first_token_time for r, q in matched])
    print(f"breakdown of the TTFT gap: client send -> handler arrival p50 "
          f"{send_to_arrival * 1e3:.2f} ms, first token -> client p50 "
          f"{token_to_client * 1e3:.2f} ms")
    print(f"\n{len(results)} streamed requests ({engine['completed']} matched in the trace), "
          f"{a.clients} concurrent, {a.max_tokens} tokens each, device "
          f"{a.device or 'auto'}, {os.cpu_count()} CPUs")
    print(f"{'':12}{'client (HTTP)':>16}{'engine':>12}{'ratio':>9}")
    for name, (c, e) in rows.items():
        print(f"{name:12}{c * 1e3:13.2f} ms{e * 1e3:9.2f} ms{c / e:9.3f}")
    if a.json:
        out = {k: {"client": c, "engine": e, "ratio": c / e} for k, (c, e) in rows.items()}
        out.update(clients=a.clients, max_tokens=a.max_tokens, rounds=a.rounds,
                   device=a.device, requests=len(results))
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
