"""Start-up times of the commands a user types first, as wall seconds and as a ratio to
``python -c "import torch"`` timed in the same rounds (the part of start-up kvloop does
not control; on a shared machine the ratio is the figure to compare).

Each round, in this order: ``import torch``; a warm ``kvloop generate --model default
--prompt hi --max-tokens 1`` per dtype (float32, bfloat16, int4: weights converted and the
token budget recorded by an untimed first run); ``kvloop serve --model default`` until
``/health`` answers; a bad prompt (empty) and a bad flag value, which must fail before
any weights load. Prints the median of ``--rounds`` rounds per command.

    python benchmarks/startup.py [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

KVLOOP = ([str(Path(sys.executable).with_name("kvloop"))]
          if Path(sys.executable).with_name("kvloop").exists() else
          [sys.executable, "-m", "kvloop.cli"])
"""The ``kvloop`` command of this Python's environment, as a user types it."""
GENERATE = [*KVLOOP, "generate", "--model", "default", "--prompt", "hi", "--max-tokens", "1"]
COMMANDS: dict[str, list[str]] = {
    "import torch": [sys.executable, "-c", "import torch"],
    "generate float32": [*GENERATE, "--dtype", "float32"],
    "generate bfloat16": [*GENERATE, "--dtype", "bfloat16"],
    "generate int4": [*GENERATE, "--quantization", "int4"],
    "bad prompt (empty)": [*KVLOOP, "generate", "--model", "default", "--prompt", ""],
    "bad flag (--dtype fp16)": [*GENERATE, "--dtype", "fp16"],
}
EXPECT_FAILURE = {"bad prompt (empty)", "bad flag (--dtype fp16)"}


def timed(cmd: list[str], fails: bool) -> float:
    """Wall seconds of ``cmd``; it must succeed (or fail, where ``fails``)."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if (proc.returncode != 0) != fails:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return wall


def serve_ready() -> float:
    """Seconds from starting ``kvloop serve --model default`` to ``/health`` answering 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    proc = subprocess.Popen([*KVLOOP, "serve", "--model", "default", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"kvloop serve exited {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - start
            except OSError:
                time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    env_note = os.environ.get("KVLOOP_CACHE_DIR", "the default cache")
    print(f"warming up (converting and recording once; cache: {env_note})...", flush=True)
    for name, cmd in COMMANDS.items():
        if name.startswith("generate"):
            timed(cmd, False)
    times: dict[str, list[float]] = {name: [] for name in [*COMMANDS, "serve ready"]}
    for _ in range(args.rounds):
        for name, cmd in COMMANDS.items():
            times[name].append(timed(cmd, name in EXPECT_FAILURE))
        times["serve ready"].append(serve_ready())
    base = statistics.median(times["import torch"])
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?") if Path("/proc/cpuinfo").exists() else "?"
    print(f"\n{cpu}, {os.cpu_count()} CPUs; median of {args.rounds} rounds; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'command':<26} {'wall s':>7} {'x import torch':>15}")
    rows = {}
    for name, values in times.items():
        med = statistics.median(values)
        rows[name] = {"median_s": med, "ratio": med / base, "all_s": values}
        print(f"{name:<26} {med:>7.2f} {med / base:>15.2f}")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
