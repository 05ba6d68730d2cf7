"""Soak: ``kvloop serve --model default`` at saturation on a KV pool too small for its load.

Starts the server as a subprocess (``--num-gpu-blocks`` small, so requests are preempted all
the time), once per preemption mode (``--preemption-mode both``: half the duration with
``recompute``, half with ``swap``). ``--clients`` concurrent httpx clients send requests back
to back for the phase's time: greedy completions and chats (streamed or not, ``ignore_eos``,
random lengths, a few shared prefixes for the prefix cache), of which ``--disconnect``
leave at a random point (mid-stream, or while waiting for a reply), and ``--bad`` are bad
requests (malformed JSON, wrong types, unknown fields, out-of-range values, too-long prompts,
a wrong model or method, bodies over ``--max-request-bytes``) that must get a 4xx.

When the load stops, each phase reports:

* requests served, refused (bad, as expected), disconnected, and failed by cause (5xx, error
  events in a stream, short or cut streams, transport errors, a bad request not refused);
* leaked KV blocks: ``/metrics`` once idle (nothing running, waiting or swapped): the
  device KV usage times the pool, which must be 0;
* a sample of served outputs (``--check-sample``) re-run alone on the same server, one at a
  time, which must be identical (greedy);
* the server's peak RSS (VmHWM), and its RSS growth per 1,000 requests (least squares of RSS
  against requests answered, after the first fifth of the phase);
* the drain: a few long streams in flight, SIGTERM, then what ``/health`` and a new request
  get, whether the streams finish, the exit code and the seconds to exit.

Not a CI test (it runs for minutes). ``--json PATH`` saves every figure.

    python benchmarks/soak.py [--duration 600] [--clients 32] [--num-gpu-blocks 32]
        [--preemption-mode both|recompute|swap] [--bad 0.05] [--disconnect 0.1]
        [--check-sample 24] [--seed 0] [--json PATH] [-- extra kvloop serve flags]

Exits 1 when any phase has a failed request, a leaked block, a solo mismatch, or a drain that
did not answer 503 to /health, complete its streams and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

MODEL = "default"
WORDS = ["the", "a", "river", "mountain", "city", "garden", "engine", "cloud", "library",
         "music", "winter", "summer", "ocean", "forest", "market", "bridge", "window",
         "letter", "story", "question", "answer", "light", "shadow", "stone", "machine",
         "history", "science", "color", "number", "journey", "friend", "morning", "evening"]
PREFIXES = [
    "You are a helpful assistant. Answer briefly and precisely. ",
    "Summarize the following notes for a busy reader who wants only the key facts: ",
    "Translate the meaning of this sentence into plain words a child understands: ",
    "",
]
SOLO_TIMEOUT_S = 300.0


# -- the server process ------------------------------------------------------------------

def cpu_name() -> tuple[str, bool]:
    """The CPU's model name and whether it has AVX-512 (``avx512f``)."""
    name, flags = platform.processor() or "unknown", ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == (platform.processor() or "unknown"):
                name = value.strip()
            elif key.strip() == "flags":
                flags = value
                break
    return name, "avx512f" in flags.split()


def serve_flags() -> str:
    """``kvloop serve --help`` (to pass only flags this tree's server knows)."""
    return subprocess.run([sys.executable, "-m", "kvloop.cli", "serve", "--help"],
                          capture_output=True, text=True, check=True).stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, flags: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvloop.cli", "serve", "--model", MODEL, "--port",
           str(port), "--log-interval", "0", "--disable-uvicorn-access-log", *flags]
    # NOTE: the log goes to a file: a pipe nobody reads would fill up and block the server.
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 900  # a first run converts the GGUF once
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"kvloop serve exited {proc.returncode}:\n{log.read_text()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("kvloop serve did not come up")
        time.sleep(0.25)


def metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            reason = s.labels.get("finished_reason")
            out[f"{s.name}{{{reason}}}" if reason else s.name] = s.value
    return out


def wait_idle(url: str, timeout: float = 120.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        busy = (m["kvloop:num_requests_running"] + m["kvloop:num_requests_waiting"]
                + m["kvloop:num_requests_swapped"])
        if (busy == 0 and m["kvloop:kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


class RssSampler(threading.Thread):
    """Samples the server's VmRSS (and reads VmHWM) twice a second, with the number of
    requests answered so far."""

    def __init__(self, pid: int, answered: list[int]) -> None:
        super().__init__(daemon=True)
        self.pid, self.answered = pid, answered
        self.samples: list[tuple[float, int, float]] = []
        self.peak_mb = 0.0
        self.stop = threading.Event()

    def read(self) -> tuple[float, float]:
        rss = hwm = 0.0
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) / 1024
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) / 1024
        return rss, hwm

    def run(self) -> None:
        while not self.stop.wait(0.5):
            try:
                rss, hwm = self.read()
            except OSError:
                return
            self.peak_mb = max(self.peak_mb, hwm)
            self.samples.append((time.monotonic(), self.answered[0], rss))


def slope_per_1000(samples: list[tuple[float, int, float]], skip_until: float) -> float:
    """MB of RSS per 1,000 requests answered (least squares), after ``skip_until``."""
    pts = [(n, rss) for t, n, rss in samples if t >= skip_until]
    if len(pts) < 2 or pts[-1][0] == pts[0][0]:
        return float("nan")
    mx = sum(n for n, _ in pts) / len(pts)
    my = sum(r for _, r in pts) / len(pts)
    var = sum((n - mx) ** 2 for n, _ in pts)
    cov = sum((n - mx) * (r - my) for n, r in pts)
    return 1000 * cov / var if var else float("nan")


# -- the load ------------------------------------------------------------------------------

@dataclass
class Stats:
    """What the clients saw in one phase."""

    served: int = 0
    refused_bad: Counter = field(default_factory=Counter)
    disconnected: int = 0
    queue_full: int = 0
    failed: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    tokens: int = 0
    done: list[dict] = field(default_factory=list)
    """Served greedy requests (body and text), a reservoir for the solo check."""
    seen: int = 0

    def fail(self, cause: str, detail: str) -> None:
        self.failed[cause] += 1
        self.examples.setdefault(cause, detail[:500])


def prompt_text(rng: random.Random) -> str:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 80)))
    return rng.choice(PREFIXES) + words


def good_request(rng: random.Random, max_tokens: int) -> tuple[str, dict]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randint(8, max_tokens),
                            "temperature": 0.0, "ignore_eos": True,
                            "stream": rng.random() < 0.7}
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.3:
        body["messages"] = [{"role": "user", "content": prompt_text(rng)}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt_text(rng)
    return "/v1/completions", body


def bad_request(rng: random.Random, max_model_len: int, max_request_bytes: int
                ) -> tuple[str, str, str, bytes]:
    """(name, method, path, raw body) of a request that must get a 4xx."""
    ok = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
    kinds: list[tuple[str, str, str, Any]] = [
        ("malformed_json", "POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": '),
        ("not_json", "POST", "/v1/completions", b"prompt=hello"),
        ("wrong_type", "POST", "/v1/completions", {**ok, "max_tokens": "5"}),
        ("unknown_field", "POST", "/v1/completions", {**ok, "bogus": 1}),
        ("max_tokens_negative", "POST", "/v1/completions", {**ok, "max_tokens": -1}),
        ("temperature_negative", "POST", "/v1/completions", {**ok, "temperature": -1.0}),
        ("prompt_too_long", "POST", "/v1/completions",
         {**ok, "prompt": [7] * (max_model_len + 5)}),
        ("token_out_of_vocab", "POST", "/v1/completions", {**ok, "prompt": [10**9]}),
        ("wrong_model", "POST", "/v1/completions", {**ok, "model": "gpt-4"}),
        ("n_0", "POST", "/v1/completions", {**ok, "n": 0}),
        ("n_over_max_num_seqs", "POST", "/v1/completions", {**ok, "n": 10**6}),
        ("best_of_0", "POST", "/v1/completions", {**ok, "best_of": 0}),
        ("empty_messages", "POST", "/v1/chat/completions", {"model": MODEL, "messages": []}),
        ("chat_wrong_role_type", "POST", "/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": 5, "content": "x"}]}),
        ("wrong_method", "GET", "/v1/completions", b""),
        ("oversize_body", "POST", "/v1/completions", None),
    ]
    name, method, path, body = rng.choice(kinds)
    if name == "oversize_body":
        raw = b'{"model": "default", "prompt": "' + b"a" * (max_request_bytes + 1024) + b'"}'
    elif isinstance(body, bytes):
        raw = body
    else:
        raw = json.dumps(body).encode()
    return name, method, path, raw


async def stream_request(http: httpx.AsyncClient, path: str, body: dict, leave_after: int | None,
                         st: Stats) -> str | None:
    """The streamed text (None when the client left or the request failed)."""
    text: list[str] = []
    finish, usage, chunks = None, None, 0
    async with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raw = (await r.aread()).decode(errors="replace")
            if r.status_code == 429:
                st.queue_full += 1
            else:
                st.fail(f"http_{r.status_code}", raw)
            return None
        if leave_after == 0:
            st.disconnected += 1
            return None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                st.fail(f"stream_error_{event['error'].get('code')}", data)
                return None
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
            if event.get("choices"):
                choice = event["choices"][0]
                text.append((choice["delta"].get("content") or "") if "delta" in choice
                            else choice["text"])
                finish = choice["finish_reason"] or finish
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    st.disconnected += 1
                    return None  # closing the response mid-stream
        else:
            st.fail("stream_cut", f"{chunks} chunks, no [DONE]")
            return None
    if finish != "length" or usage != body["max_tokens"]:
        st.fail("stream_incomplete", f"finish_reason={finish} usage={usage} "
                f"max_tokens={body['max_tokens']}")
        return None
    st.tokens += usage
    return "".join(text)


async def plain_request(http: httpx.AsyncClient, path: str, body: dict, give_up_s: float | None,
                        st: Stats) -> str | None:
    try:
        r = await http.post(path, json=body, timeout=give_up_s or 600)
    except httpx.TimeoutException:
        if give_up_s is None:
            raise
        st.disconnected += 1
        return None
    if r.status_code == 429:
        st.queue_full += 1
        return None
    if r.status_code != 200:
        st.fail(f"http_{r.status_code}", r.text)
        return None
    reply = r.json()
    choice = reply["choices"][0]
    if choice["finish_reason"] != "length" or reply["usage"]["completion_tokens"] != \
            body["max_tokens"]:
        st.fail("reply_incomplete", json.dumps(reply)[:500])
        return None
    st.tokens += reply["usage"]["completion_tokens"]
    return choice["message"]["content"] if "message" in choice else choice["text"]


async def client_loop(http: httpx.AsyncClient, rng: random.Random, a: argparse.Namespace,
                      deadline: float, st: Stats, answered: list[int], sample: random.Random
                      ) -> None:
    while time.monotonic() < deadline:
        try:
            if rng.random() < a.bad:
                name, method, path, raw = bad_request(rng, a.max_model_len,
                                                      a.max_request_bytes)
                r = await http.request(method, path, content=raw,
                                       headers={"content-type": "application/json"})
                if 400 <= r.status_code < 500 and r.status_code != 429:
                    st.refused_bad[f"{name}_{r.status_code}"] += 1
                elif r.status_code == 429:
                    st.queue_full += 1
                else:
                    st.fail(f"bad_request_{r.status_code}", f"{name}: {r.text}")
                continue
            path, body = good_request(rng, a.max_tokens)
            leave = rng.random() < a.disconnect
            if body["stream"]:
                text = await stream_request(
                    http, path, body, rng.randint(0, body["max_tokens"] - 1) if leave else None,
                    st)
            else:
                text = await plain_request(http, path, body,
                                           rng.uniform(0.05, 3.0) if leave else None, st)
            if text is not None:
                st.served += 1
                st.seen += 1  # reservoir sampling of served requests for the solo check
                item = {"path": path, "body": body, "text": text}
                if len(st.done) < a.check_sample:
                    st.done.append(item)
                elif (j := sample.randrange(st.seen)) < a.check_sample:
                    st.done[j] = item
        except httpx.HTTPError as exc:
            st.fail(f"transport_{type(exc).__name__}", repr(exc))
        finally:
            answered[0] += 1


async def drive(url: str, a: argparse.Namespace, seconds: float, st: Stats,
                answered: list[int], seed: int) -> None:
    limits = httpx.Limits(max_connections=a.clients + 4, max_keepalive_connections=a.clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        deadline = time.monotonic() + seconds
        sample = random.Random(seed + 1)
        await asyncio.gather(*(client_loop(http, random.Random(seed * 1000 + i), a, deadline,
                                           st, answered, sample) for i in range(a.clients)))


# -- after the load ------------------------------------------------------------------------

def solo_check(url: str, items: list[dict]) -> dict[str, Any]:
    """Re-run each sampled request alone (non-streamed, one at a time): same text?"""
    mismatches = []
    with httpx.Client(base_url=url, timeout=SOLO_TIMEOUT_S) as http:
        for item in items:
            body = {**item["body"], "stream": False}
            body.pop("stream_options", None)
            r = http.post(item["path"], json=body)
            r.raise_for_status()
            choice = r.json()["choices"][0]
            solo = choice["message"]["content"] if "message" in choice else choice["text"]
            if solo != item["text"]:
                common = next((i for i, (x, y) in enumerate(zip(solo, item["text"],
                                                                strict=False)) if x != y),
                              min(len(solo), len(item["text"])))
                mismatches.append({"path": item["path"], "max_tokens": body["max_tokens"],
                                   "first_difference_at_char": common,
                                   "under_load": item["text"][:200], "solo": solo[:200]})
    return {"checked": len(items), "identical": len(items) - len(mismatches),
            "tokens_checked": sum(i["body"]["max_tokens"] for i in items),
            "mismatches": mismatches}


def drain(url: str, proc: subprocess.Popen, streams: int = 4) -> dict[str, Any]:
    """Long streams in flight, then SIGTERM: what new requests and /health get, whether the
    streams finish, the exit code and the time to exit."""
    body = {"model": MODEL, "prompt": "Tell a long story about a lighthouse keeper.",
            "max_tokens": 48, "temperature": 0.0, "ignore_eos": True, "stream": True}
    started = threading.Barrier(streams + 1)
    outcomes: list[str] = []

    def one() -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                started.wait(60)
                events = [first, *(line for line in lines if line.startswith("data: "))]
            last = [e for e in events if e != "data: [DONE]"][-1]
            ok = events[-1] == "data: [DONE]" and '"finish_reason":"length"' in last
            outcomes.append("completed" if ok else f"cut: {last[:200]}")
        except Exception as exc:
            outcomes.append(f"error: {exc!r}")
            with contextlib.suppress(threading.BrokenBarrierError):
                started.abort()

    threads = [threading.Thread(target=one, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        started.wait(120)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    probes: dict[str, Any] = {}
    for name, method, path, payload in (("health", "GET", "/health", None),
                                        ("new_request", "POST", "/v1/completions",
                                         {**body, "stream": False, "max_tokens": 4})):
        try:
            probes[name] = httpx.request(method, f"{url}{path}", json=payload,
                                         timeout=10).status_code
        except httpx.HTTPError as exc:
            probes[name] = type(exc).__name__
    for t in threads:
        t.join(180)
    try:
        rc = proc.wait(180)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait(10)
    return {"exit_code": rc, "seconds_to_exit": round(time.monotonic() - t0, 2),
            "streams_in_flight": streams,
            "streams_completed": sum(o == "completed" for o in outcomes),
            "stream_outcomes": sorted(Counter(outcomes).items()),
            "health_while_draining": probes["health"],
            "new_request_while_draining": probes["new_request"]}


# -- one phase -----------------------------------------------------------------------------

def phase(mode: str, seconds: float, a: argparse.Namespace, extra: list[str], seed: int,
          tmp: Path) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # NOTE: vLLM's admission and victims, so the small pool preempts all the time (cost-aware
    # preemption would mostly avoid it; pass --cost-aware-preemption after -- to soak that).
    flags = ["--num-gpu-blocks", str(a.num_gpu_blocks), "--preemption-mode", mode,
             "--no-cost-aware-preemption",
             "--swap-space", str(a.swap_space if mode == "swap" else 0),
             "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs),
             *extra]
    if "--max-request-bytes" in serve_flags():
        flags += ["--max-request-bytes", str(a.max_request_bytes)]
    log = tmp / f"serve-{mode}.log"
    t0 = time.monotonic()
    proc = start_server(port, flags, log)
    print(f"[{mode}] server up in {time.monotonic() - t0:.1f} s; {a.clients} clients for "
          f"{seconds:.0f} s", flush=True)
    try:
        st, answered = Stats(), [0]
        sampler = RssSampler(proc.pid, answered)
        sampler.start()
        start = time.monotonic()
        asyncio.run(drive(url, a, seconds, st, answered, seed))
        load_s = time.monotonic() - start
        idle = wait_idle(url)
        leaked = round(idle["kvloop:kv_cache_usage_perc"] * a.num_gpu_blocks)
        stuck = {k.split(":")[1]: idle[f"kvloop:{k.split(':')[1]}"] for k in
                 ("kvloop:num_requests_running", "kvloop:num_requests_waiting",
                  "kvloop:num_requests_swapped")}
        print(f"[{mode}] load done in {load_s:.0f} s: {st.served} served; checking "
              f"{len(st.done)} outputs alone", flush=True)
        solo = solo_check(url, st.done)
        after = wait_idle(url)
        sampler.stop.set()
        sampler.join()
        rss = [s[2] for s in sampler.samples]
        drained = drain(url, proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    total = st.served + sum(st.refused_bad.values()) + st.disconnected + st.queue_full + \
        sum(st.failed.values())
    return {
        "preemption_mode": mode,
        "load_seconds": round(load_s, 1),
        "requests": total,
        "served": st.served,
        "served_per_s": round(st.served / load_s, 2),
        "output_tokens_served": st.tokens,
        "refused_bad_requests": sum(st.refused_bad.values()),
        "refused_by_kind": dict(sorted(st.refused_bad.items())),
        "disconnected_by_client": st.disconnected,
        "queue_full_429": st.queue_full,
        "failed": sum(st.failed.values()),
        "failed_by_cause": dict(sorted(st.failed.items())),
        "failure_examples": st.examples,
        "preemptions": int(idle.get("kvloop:num_preemptions_total", 0)),
        "server_finished_by_reason": {k.split("{")[1].rstrip("}"): int(v) for k, v in
                                      idle.items() if k.startswith("kvloop:request_success")},
        "server_failed_requests": int(idle.get("kvloop:num_requests_failed_total", 0)),
        "leaked_blocks_after_load": leaked,
        "stuck_after_load": stuck,
        "leaked_blocks_after_checks": round(after["kvloop:kv_cache_usage_perc"]
                                            * a.num_gpu_blocks),
        "solo_check": solo,
        "rss_mb": {"first": round(rss[0], 1) if rss else None,
                   "last": round(rss[-1], 1) if rss else None,
                   "peak_hwm": round(sampler.peak_mb, 1),
                   "growth_per_1000_requests": round(
                       slope_per_1000(sampler.samples, start + load_s / 5), 2)},
        "drain": drained,
        "server_log_tail": log.read_text()[-2000:],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=600.0,
                    help="seconds of load in all (split between the modes; default 600)")
    ap.add_argument("--clients", type=int, default=32, help="concurrent clients")
    ap.add_argument("--preemption-mode", choices=["both", "recompute", "swap"], default="both")
    ap.add_argument("--num-gpu-blocks", type=int, default=32,
                    help="KV blocks of 16 tokens (default 32: a few requests' worth)")
    ap.add_argument("--swap-space", type=float, default=0.05, help="GiB of host swap tier")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64, help="most output tokens a request")
    ap.add_argument("--max-request-bytes", type=int, default=1 << 20)
    ap.add_argument("--bad", type=float, default=0.05, help="fraction of bad requests")
    ap.add_argument("--disconnect", type=float, default=0.1,
                    help="fraction of clients that leave early")
    ap.add_argument("--check-sample", type=int, default=24,
                    help="served outputs re-run alone per phase")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="save the figures as JSON")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="after --: kvloop serve flags")
    a = ap.parse_args()
    extra = [x for x in a.extra if x != "--"]
    modes = ["recompute", "swap"] if a.preemption_mode == "both" else [a.preemption_mode]
    cpu, avx512 = cpu_name()
    report: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "cpu": cpu, "avx512f": avx512, "cpus": os.cpu_count(),
        "config": {k: v for k, v in vars(a).items() if k not in ("json", "extra")},
        "extra_serve_flags": extra, "phases": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for i, mode in enumerate(modes):
            report["phases"].append(phase(mode, a.duration / len(modes), a, extra,
                                          a.seed + 7919 * i, Path(tmp)))
    print_report(report)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    ok = all(p["failed"] == 0 and p["leaked_blocks_after_load"] == 0
             and p["leaked_blocks_after_checks"] == 0 and not p["solo_check"]["mismatches"]
             and p["drain"]["exit_code"] == 0 and p["drain"]["health_while_draining"] == 503
             and p["drain"]["streams_completed"] == p["drain"]["streams_in_flight"]
             for p in report["phases"])
    return 0 if ok else 1


def print_report(r: dict[str, Any]) -> None:
    print(f"\n{r['cpu']} (avx512f: {'yes' if r['avx512f'] else 'no'}), {r['cpus']} CPUs")
    for p in r["phases"]:
        rss, d, solo = p["rss_mb"], p["drain"], p["solo_check"]
        print(f"\n== {p['preemption_mode']}: {p['load_seconds']:.0f} s of load, "
              f"{p['preemptions']} preemptions")
        print(f"requests {p['requests']}: served {p['served']} ({p['served_per_s']}/s, "
              f"{p['output_tokens_served']} tokens), bad refused {p['refused_bad_requests']}, "
              f"disconnected {p['disconnected_by_client']}, 429 {p['queue_full_429']}, "
              f"failed {p['failed']} {p['failed_by_cause'] or ''}")
        print(f"solo greedy check: {solo['identical']}/{solo['checked']} identical "
              f"({solo['tokens_checked']} tokens)")
        print(f"leaked blocks: {p['leaked_blocks_after_load']} after load, "
              f"{p['leaked_blocks_after_checks']} after the checks; stuck "
              f"{p['stuck_after_load']}")
        print(f"RSS: {rss['first']} -> {rss['last']} MB, peak {rss['peak_hwm']} MB, "
              f"{rss['growth_per_1000_requests']} MB per 1,000 requests")
        print(f"drain: exit {d['exit_code']} in {d['seconds_to_exit']} s, "
              f"{d['streams_completed']}/{d['streams_in_flight']} streams completed, "
              f"/health {d['health_while_draining']}, new request "
              f"{d['new_request_while_draining']}")


if __name__ == "__main__":
    raise SystemExit(main())
