"""Scheduling policies on the real engine: ``kvloop serve --model default`` under each policy,
driven by ``kvloop bench serve`` with the same seeded overload.

The simulator comparison (``benchmarks/policies.py``) covers real traces at GPU scale; this is
its small real-engine counterpart on this machine: a few dozen requests with random lengths,
Poisson arrivals above what the CPU serves, one heavy tenant sending 60% of them and four
light ones 10% each (the OpenAI ``user`` field). Each policy gets a fresh server (same
flags otherwise); one run after the other, so every figure comes from the same machine
state as its neighbours. Reported per policy: goodput (requests meeting both SLOs per
second), TTFT and TPOT p50/p99, failed/rejected requests, Jain's index over tenants'
service while requests arrive, the heavy tenant's share of it, and the server's
preemptions and recomputed tokens (``/metrics``).

    python benchmarks/policies_engine.py [--num-prompts 60] [--rate 3.5] [--slo-ttft 4]
        [--slo-tpot 0.3]
        [--policies fcfs,prefill-first,slo,slo-reject,fair,fcfs-newest,sjf,mlfq,balanced]
        [--num-gpu-blocks 96] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from kvloop.bench import ServeBenchConfig, run_bench

CONFIGS: dict[str, list[str]] = {
    "fcfs": ["--scheduling-policy", "fcfs"],
    "fcfs-newest": ["--scheduling-policy", "fcfs", "--no-cost-aware-preemption"],
    "prefill-first": ["--scheduling-policy", "fcfs", "--scheduling-order", "prefill-first"],
    "slo": ["--scheduling-policy", "slo"],
    "slo-reject": ["--scheduling-policy", "slo", "--slo-overload", "reject"],
    "fair": ["--scheduling-policy", "fair"],
    "sjf": ["--scheduling-policy", "sjf", "--length-predictor", "history"],
    "mlfq": ["--scheduling-policy", "mlfq"],
    "balanced": ["--scheduling-policy", "balanced", "--length-predictor", "history"],
}
"""Policy label -> ``kvloop serve`` flags (SLO targets and the KV pool are added to all)."""
TENANT_MIX = "0.6,0.1,0.1,0.1,0.1"


def cpu_name() -> str:
    """This machine's CPU as the profiler names it (model, vector extensions, threads)."""
    import torch

    from kvloop.executor.torch.profiler import device_name

    return device_name(torch.device("cpu"))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_default(flags: list[str], port: int, env: dict[str, str] | None = None
           ) -> Iterator[subprocess.Popen]:
    """``kvloop serve --model default --port PORT FLAGS`` (with ``env`` added), once healthy;
    stopped with SIGTERM on leaving (its whole process group killed if it lingers: a
    ``--replicas`` server owns Ray's processes). Its stderr goes to a temporary file (Ray
    logs a lot: a pipe nobody reads would fill and stall it), quoted when it fails."""
    cmd = [sys.executable, "-m", "kvloop.cli", "serve", "--model", "default", "--port",
           str(port), *flags]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log,
                                env={**os.environ, **(env or {}),
                                     "RAY_USAGE_STATS_ENABLED": "0"},
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"kvloop serve {' '.join(flags)} did not become "
                                       f"healthy: {log.read()[-2000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"http://127.0.0.1:{port}/health",
                                 timeout=2).status_code == 200:
                        break
                time.sleep(0.5)
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=90)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


def _counter(metrics: str, name: str) -> float:
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            m = re.search(r"\s([0-9.eE+-]+)$", line)
            if m:
                total += float(m.group(1))
    return total


def run_one(label: str, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    flags = [*CONFIGS[label], "--slo-ttft", str(args.slo_ttft), "--slo-tpot", str(args.slo_tpot),
             "--num-gpu-blocks", str(args.num_gpu_blocks)]
    with serve_default(flags, port):
        cfg = ServeBenchConfig(
            base_url=f"http://127.0.0.1:{port}", num_prompts=args.num_prompts,
            request_rate=args.rate, random_input_len=args.input_len,
            random_output_len=args.output_len, random_range_ratio=0.5, ignore_eos=True,
            tenant_mix=TENANT_MIX, seed=args.seed, progress=False,
            goodput={"ttft": args.slo_ttft, "tpot": args.slo_tpot})
        report = run_bench(cfg)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    s = report["summary"]
    tenants = s.get("tenants") or {}
    served = sum(t["service_tokens"] for t in tenants.values()) or 1
    light = [t["service_tokens"] for n, t in tenants.items() if n != "t0"]
    light_jain = (sum(light) ** 2 / (len(light) * sum(x * x for x in light))
                  if light and any(light) else None)
    return {
        "policy": label, "completed": s["completed"], "failed": s.get("failed", 0),
        "errors": report["errors"], "goodput": s["goodput"],
        "request_throughput": s["request_throughput"],
        "ttft_p50": s["ttft"]["p50"], "ttft_p99": s["ttft"]["p99"],
        "e2e_mean": s["e2e"]["mean"], "e2e_p99": s["e2e"]["p99"],
        "attainment": (s.get("slo_attainment") or {}).get("both"),
        "qoe": (s.get("qoe") or {}).get("mean"),
        "tpot_p50": s["tpot"]["p50"], "tpot_p99": s["tpot"]["p99"],
        "jain_index": s.get("jain_index"), "jain_light": light_jain,
        "heavy_share": tenants.get("t0", {}).get("service_tokens", 0) / served,
        "preemptions": _counter(metrics, "kvloop:num_preemptions_total"),
        "recomputed_tokens": _counter(metrics, "kvloop:recomputed_tokens_total"),
    }


def _fmt(x: Any, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--rate", type=float, default=3.5,
                   help="req/s (Poisson); 3.5 overloads the default model in bfloat16 on a "
                        "2-core AVX-512-BF16 VM about 2.3x")
    p.add_argument("--input-len", type=int, default=160)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--slo-ttft", type=float, default=4.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.3, help="seconds")
    p.add_argument("--num-gpu-blocks", type=int, default=96,
                   help="a KV pool small enough to preempt (default: %(default)s)")
    p.add_argument("--policies", default=",".join(CONFIGS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    labels = [x for x in args.policies.split(",") if x]
    unknown = set(labels) - set(CONFIGS)
    if unknown:
        p.error(f"unknown policies {sorted(unknown)}; choose from {', '.join(CONFIGS)}")
    print(f"# {cpu_name()}; {args.num_prompts} requests at {args.rate} req/s, tenants {TENANT_MIX},"
          f" SLO TTFT {args.slo_ttft} s / TPOT {args.slo_tpot} s, {args.num_gpu_blocks} KV "
          "blocks", flush=True)
    rows = []
    for label in labels:
        started = time.perf_counter()
        rows.append(run_one(label, args))
        print(f"  {label}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    head = ("| policy | goodput req/s | SLO attained | done | failed | TTFT p50/p99 s | "
            "e2e mean/p99 s | TPOT p50/p99 ms | QoE | Jain (all / light) | heavy share | "
            "preempt | recomputed |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        print(f"| {r['policy']} | {_fmt(r['goodput'], digits=3)} | "
              f"{_fmt(r['attainment'], 100, 0)}% | {r['completed']} | "
              f"{r['failed']} | {_fmt(r['ttft_p50'])} / {_fmt(r['ttft_p99'])} | "
              f"{_fmt(r['e2e_mean'])} / {_fmt(r['e2e_p99'])} | "
              f"{_fmt(r['tpot_p50'], 1000, 0)} / {_fmt(r['tpot_p99'], 1000, 0)} | "
              f"{_fmt(r['qoe'], digits=3)} | "
              f"{_fmt(r['jain_index'])} / {_fmt(r['jain_light'])} | "
              f"{_fmt(r['heavy_share'])} | {r['preemptions']:.0f} | "
              f"{r['recomputed_tokens']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "args": vars(args), "rows": rows},
                                              indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
