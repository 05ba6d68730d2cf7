"""Scheduler overhead: microseconds per ``schedule()`` + ``update_from_output()`` pair.

No executor runs: each step's ``ModelRunnerOutput`` is built directly (token 0 sampled for
every scheduled request, ``step_time_s`` 0) and that construction is left out of the timing,
as are ``add_request`` calls and building ``Request`` objects. Only the two scheduler calls
are timed, with ``time.perf_counter``, and summed over K steps; each measurement is repeated
on a fresh scheduler and the median (and best) of the repeats is reported.

Scenarios, each at N = 64 / 256 / 1024 running requests:

- ``decode``: N requests with distinct 128-token prompts, ``ignore_eos`` and a ``max_tokens``
  large enough that none finishes; warmed up until every request is decoding, then K
  decode-only steps are timed. Run with prefix caching on and (``decode-nopc``) off.
- ``mixed``: long-lived decodes plus one new distinct 512-token prompt (16 output tokens)
  arriving every step, chunked prefill on with a 256-token chunk cap, so every step holds
  the second chunk of the previous prompt, the first chunk of the new one and the decodes,
  and a stream request finishes every step. The number of long-lived decodes is chosen so
  the mean number of running requests is about N (the table reports the measured mean).

Config: block_size 16, max_num_batched_tokens 8192, max_num_seqs N + 64, FCFS,
decode-first, recompute preemption, no step recorder (``--record`` adds one). The device
pool is sized to every block the requests can ever hold plus 10%, so nothing is preempted
(checked: a run with a preemption raises).

The target is at most 2 µs per running request per step; ``ratio`` is the measured cost over
that budget (``0.80x`` is within it).

Run (from the repository root, with the project's virtual environment active)::

    python benchmarks/scheduler_overhead.py              # K=200 steps, 5 repeats
    python benchmarks/scheduler_overhead.py --quick      # K=20 steps, 3 repeats
    python benchmarks/scheduler_overhead.py --json out_sched.json --profile
    python benchmarks/scheduler_overhead.py --cpu-time   # on a busy shared machine
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import math
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core import ModelRunnerOutput, Request, Scheduler, StepRecorder
from kvloop.sampling_params import SamplingParams

BUDGET_US_PER_REQ = 2.0
"""Target: scheduler cost per running request per step, in microseconds."""
BLOCK_SIZE = 16
MAX_BATCHED_TOKENS = 8192
SEQ_MARGIN = 64
DECODE_PROMPT_LEN = 128
STREAM_PROMPT_LEN = 512
STREAM_OUTPUT_LEN = 16
STREAM_CHUNK = 256
WARM_STEPS = 5
"""Extra untimed steps once the scenario reached its steady state."""
SIZES = (64, 256, 1024)
_TOKEN: tuple[int, ...] = (0,)
_TIMER = [time.perf_counter]
"""What ``_step`` times with: wall time, or thread CPU time (``--cpu-time``)."""


@dataclass
class Row:
    scenario: str
    n: int
    prefix_caching: bool
    steps: int
    repeats: int
    mean_running: float
    us_per_step_median: float
    us_per_step_best: float
    us_per_req_median: float
    us_per_req_best: float
    budget_ratio: float
    num_gpu_blocks: int
    finished_per_step: float
    new_per_step: float
    prefill_tokens_per_step: float


@dataclass
class RunResult:
    seconds: float
    mean_running: float
    finished: int
    admitted: int
    prefill_tokens: int


class _Ids:
    """Distinct token ids for every prompt, so no two prompts share a block."""

    def __init__(self) -> None:
        self.next = 1000

    def take(self, n: int) -> list[int]:
        start = self.next
        self.next += n
        return list(range(start, start + n))


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


POLICY: dict[str, object] = {}
"""Policy fields for every scheduler (``--policy``; empty: fcfs)."""


def _make_scheduler(
    n_seqs: int, num_gpu_blocks: int, prefix: bool, record: bool, chunk: int, max_len: int
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=MAX_BATCHED_TOKENS,
            max_num_seqs=n_seqs + SEQ_MARGIN,
            max_model_len=max_len,
            enable_chunked_prefill=True,
            long_prefill_token_threshold=chunk,
            **POLICY,  # type: ignore[arg-type]
        ),
        CacheConfig(
            block_size=BLOCK_SIZE,
            num_gpu_blocks=num_gpu_blocks,
            enable_prefix_caching=prefix,
        ),
        clock=time.perf_counter,
        recorder=StepRecorder() if record else None,
    )


def _step(s: Scheduler) -> float:
    """One step; returns seconds spent in the two scheduler calls (harness excluded)."""
    now = _TIMER[0]
    t0 = now()
    out = s.schedule()
    t1 = now()
    result = ModelRunnerOutput(
        sampled_token_ids=dict.fromkeys(out.num_scheduled_tokens, _TOKEN), step_time_s=0.0
    )
    t2 = now()
    s.update_from_output(out, result)
    return (t1 - t0) + (now() - t2)


def _long_request(rid: str, ids: _Ids, max_tokens: int) -> Request:
    return Request(
        rid,
        ids.take(DECODE_PROMPT_LEN),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def _stream_requests(ids: _Ids, count: int) -> Iterator[Request]:
    for i in range(count):
        yield Request(
            f"s{i}",
            ids.take(STREAM_PROMPT_LEN),
            SamplingParams(max_tokens=STREAM_OUTPUT_LEN, ignore_eos=True),
        )


def _warm_long(s: Scheduler, reqs: list[Request]) -> None:
    for r in reqs:
        s.add_request(r)
    for _ in range(10_000):
        if all(r.output_token_ids for r in reqs):
            return
        _step(s)
    raise RuntimeError("warm-up did not bring every request to decoding")


def decode_sizes(n: int, steps: int) -> tuple[int, int]:
    """(max_tokens, num_gpu_blocks) of the decode scenario."""
    # Prefill takes ceil(N * prompt / budget) steps; then warm-up and timed steps.
    max_tokens = WARM_STEPS + steps + 64
    blocks = n * _blocks(DECODE_PROMPT_LEN + max_tokens)
    return max_tokens, int(blocks * 1.1) + 16


def run_decode(
    n: int, steps: int, prefix: bool, record: bool, profiler: cProfile.Profile | None = None
) -> RunResult:
    max_tokens, num_blocks = decode_sizes(n, steps)
    s = _make_scheduler(n, num_blocks, prefix, record, 0, DECODE_PROMPT_LEN + max_tokens)
    ids = _Ids()
    reqs = [_long_request(f"d{i}", ids, max_tokens) for i in range(n)]
    _warm_long(s, reqs)
    for _ in range(WARM_STEPS):
        _step(s)
    gc.collect()
    if profiler is not None:
        profiler.enable()
    total = 0.0
    for _ in range(steps):
        total += _step(s)
    if profiler is not None:
        profiler.disable()
    if len(s.running) != n or s.stats.num_preemptions or s.num_waiting:
        raise RuntimeError(f"decode N={n}: not a steady decode batch ({len(s.running)} running)")
    return RunResult(total, float(n), 0, 0, 0)


def mixed_sizes(n: int, steps: int) -> tuple[int, int, int, int]:
    """(long-lived requests, their max_tokens, stream requests, num_gpu_blocks)."""
    in_flight = STREAM_OUTPUT_LEN + math.ceil(STREAM_PROMPT_LEN / STREAM_CHUNK) - 1
    n_long = max(1, n - in_flight)
    warm = STREAM_OUTPUT_LEN + 8 + WARM_STEPS
    max_tokens = warm + steps + 64
    n_stream = warm + steps
    blocks = n_long * _blocks(DECODE_PROMPT_LEN + max_tokens)
    blocks += (in_flight + 2) * _blocks(STREAM_PROMPT_LEN + STREAM_OUTPUT_LEN)
    return n_long, max_tokens, n_stream, int(blocks * 1.1) + 16


def run_mixed(n: int, steps: int, prefix: bool, record: bool) -> RunResult:
    n_long, max_tokens, n_stream, num_blocks = mixed_sizes(n, steps)
    max_len = max(DECODE_PROMPT_LEN + max_tokens, STREAM_PROMPT_LEN + STREAM_OUTPUT_LEN)
    s = _make_scheduler(n, num_blocks, prefix, record, STREAM_CHUNK, max_len)
    ids = _Ids()
    reqs = [_long_request(f"d{i}", ids, max_tokens) for i in range(n_long)]
    _warm_long(s, reqs)
    stream = _stream_requests(ids, n_stream)
    for _ in range(n_stream - steps):  # fill the stream to its steady state
        s.add_request(next(stream))
        _step(s)
    gc.collect()
    total = 0.0
    running = 0
    fin0 = sum(s.stats.finished_by_reason.values())
    prompt0 = s.stats.num_prompt_tokens
    admitted = 0
    for _ in range(steps):
        s.add_request(next(stream))
        before = s.num_waiting
        total += _step(s)
        admitted += before - s.num_waiting
        running += len(s.running)
    if s.stats.num_preemptions:
        raise RuntimeError(f"mixed N={n}: {s.stats.num_preemptions} preemptions")
    finished = sum(s.stats.finished_by_reason.values()) - fin0
    prefill = s.stats.num_prompt_tokens - prompt0
    return RunResult(total, running / steps, finished, admitted, prefill)


SCENARIOS = {
    "decode": (run_decode, True),
    "decode-nopc": (run_decode, False),
    "mixed": (run_mixed, True),
}


def measure(scenario: str, n: int, steps: int, repeats: int, record: bool) -> Row:
    fn, prefix = SCENARIOS[scenario]
    runs = [fn(n, steps, prefix, record) for _ in range(repeats)]
    per_step = sorted(r.seconds / steps * 1e6 for r in runs)
    median = statistics.median(per_step)
    mean_running = statistics.fmean(r.mean_running for r in runs)
    blocks = decode_sizes(n, steps)[1] if fn is run_decode else mixed_sizes(n, steps)[3]
    return Row(
        scenario=scenario,
        n=n,
        prefix_caching=prefix,
        steps=steps,
        repeats=repeats,
        mean_running=mean_running,
        us_per_step_median=median,
        us_per_step_best=per_step[0],
        us_per_req_median=median / mean_running,
        us_per_req_best=per_step[0] / mean_running,
        budget_ratio=median / mean_running / BUDGET_US_PER_REQ,
        num_gpu_blocks=blocks,
        finished_per_step=statistics.fmean(r.finished for r in runs) / steps,
        new_per_step=statistics.fmean(r.admitted for r in runs) / steps,
        prefill_tokens_per_step=statistics.fmean(r.prefill_tokens for r in runs) / steps,
    )


def print_table(rows: list[Row]) -> None:
    head = (
        f"{'scenario':<12} {'N':>5} {'running':>8} {'us/step med':>12} {'best':>9} "
        f"{'us/req/step':>12} {'best':>6}  {'vs 2us budget':<18} {'blocks':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r.scenario:<12} {r.n:>5} {r.mean_running:>8.1f} {r.us_per_step_median:>12.1f} "
            f"{r.us_per_step_best:>9.1f} {r.us_per_req_median:>12.2f} {r.us_per_req_best:>6.2f}"
            f"  {f'{r.budget_ratio:.2f}x of budget':<18} {r.num_gpu_blocks:>7}"
        )
    mixed = [r for r in rows if r.scenario == "mixed"]
    for r in mixed:
        print(
            f"  mixed N={r.n}: per step {r.new_per_step:.2f} admitted, "
            f"{r.finished_per_step:.2f} finished, "
            f"{r.prefill_tokens_per_step:.0f} prompt tokens (as SchedulerStats counts them)"
        )


def profile_decode(n: int, steps: int, record: bool) -> None:
    prof = cProfile.Profile()
    run_decode(n, steps, True, record, profiler=prof)
    print(f"\ncProfile: decode N={n}, {steps} steps (prefix caching on), top 15 by tottime")
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(15)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="K=20 steps, 3 repeats")
    p.add_argument("--steps", type=int, default=None, help="K, timed steps per run")
    p.add_argument("--repeats", type=int, default=None, help="runs per measurement")
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="values of N")
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    p.add_argument("--record", action="store_true", help="attach an in-memory StepRecorder")
    p.add_argument("--profile", action="store_true", help="cProfile one decode N=1024 run")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    p.add_argument("--cpu-time", action="store_true",
                   help="time in thread CPU time, not wall time (a busy shared machine's "
                   "waits for a core drop out)")
    p.add_argument("--policy", default="fcfs", choices=["fcfs", "priority", "slo", "fair"],
                   help="scheduling policy (slo: TTFT 10 s, TPOT 1 s targets)")
    args = p.parse_args(argv)
    if args.cpu_time:
        _TIMER[0] = time.thread_time
    POLICY.update(policy=args.policy)
    if args.policy == "slo":
        POLICY.update(slo_ttft=10.0, slo_tpot=1.0)
    steps = args.steps or (20 if args.quick else 200)
    repeats = args.repeats or (3 if args.quick else 5)

    print(
        f"kvloop scheduler overhead: K={steps} steps x {repeats} repeats, "
        f"block_size {BLOCK_SIZE}, max_num_batched_tokens {MAX_BATCHED_TOKENS}, "
        f"max_num_seqs N+{SEQ_MARGIN}, recorder {'on' if args.record else 'off'}, "
        f"policy {args.policy}, {'thread CPU' if args.cpu_time else 'wall'} time, "
        f"Python {platform.python_version()}"
    )
    print(
        "GPU blocks: every block the requests can hold + 10% (no preemption; checked). "
        f"decode: {DECODE_PROMPT_LEN}-token prompts; mixed: one {STREAM_PROMPT_LEN}-token "
        f"prompt/step, {STREAM_OUTPUT_LEN} output tokens, chunk cap {STREAM_CHUNK}.\n"
    )
    rows: list[Row] = []
    for scenario in args.scenarios:
        for n in args.sizes:
            rows.append(measure(scenario, n, steps, repeats, args.record))
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "budget_us_per_request_step": BUDGET_US_PER_REQ,
                    "python": platform.python_version(),
                    "record": args.record,
                    "rows": [asdict(r) for r in rows],
                },
                f,
                indent=2,
            )
        print(f"\nwrote {args.json}")
    if args.profile:
        profile_decode(1024, steps, args.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
