"""Self-validation: kvloop's simulator against kvloop's own torch engine on this machine.

1. ``kvloop profile`` the model on this device (or reuse ``--calibration``).
2. Serve a real workload with the torch engine in this process: ``--num-requests`` prompts
   whose (prompt, output) lengths are drawn from the shipped ShareGPT trace and scaled by
   ``--scale`` to suit the small model and the machine, random prompt token ids, outputs
   forced to their length (``ignore_eos``), Poisson arrivals at ``--request-rate`` in real
   time (requests join at step boundaries with their true arrival time, as through the
   server). Every step is recorded (``--trace-out``).
3. Simulate the very same requests (arrivals, lengths, token ids, scheduler and KV-cache
   configuration) with the calibration.
4. Print measured vs simulated TTFT / TPOT / e2e (mean, p50, p90) with % errors, and the
   step-by-step error: each recorded step's batch costed by the same cost model against
   the measured time from its start to the next step's start (steps followed by an idle
   wait left out).
5. Simulate the same requests once more with the served run's own step times as the cost
   model (``kvloop.sim.measured``): what is left is the simulation loop's own error.
6. Print how fast the machine was during the run relative to the profile: a reference
   forward pass (64 tokens, attention left out) timed on the engine's runner before and
   after serving, against the calibration's table. On a shared VM this drifts by several
   percent within minutes, and every step of the run drifts with it.

With ``--serve-twice`` the same requests are served a second time right after the first
(a fresh engine, the same KV pool), and the mean/median differences between the two real
runs are printed: how far apart this machine puts two measurements of the same thing, a
floor under any simulator's error here. With ``--profile-twice`` too, the second profile
comes after both serves.

With ``--profile-twice`` the model is profiled again right after serving, and the
calibration is fitted to the mean of the two profiles' timings (same items, same order):
a machine drifting steadily over the run is then calibrated at its mid-run speed. The
worst error with the first profile alone is printed beside it. Both profiles time
synthetic items only; nothing is fitted to the served run.

    python benchmarks/sim_fidelity.py [--num-requests 100] [--request-rate 1.5]
        [--scale 0.125] [--calibration PATH] [--profile-twice] [--serve-twice]
        [--trace-out PATH]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path

from kvloop.cli import main as kvloop_main
from kvloop.config import CacheConfig
from kvloop.core.stats import StepRecorder
from kvloop.engine.args import EngineArgs
from kvloop.engine.llm_engine import LLMEngine
from kvloop.executor.simulated import CostModel
from kvloop.executor.simulated.calibration import Calibration, Measurements
from kvloop.executor.simulated.fitting import fit_calibration
from kvloop.sampling_params import SamplingParams
from kvloop.sim.driver import simulate
from kvloop.sim.measured import MeasuredSteps, record_key
from kvloop.sim.metrics import percentile, summarize_requests
from kvloop.sim.traces import WorkloadRequest, trace_lengths
from kvloop.viz.summary import reconstruct_requests

METRICS = ("ttft", "tpot", "e2e")
REFERENCE_TOKENS = 64
QUANTILES = ("mean", "p50", "p90")


def make_workload(n: int, rate: float, scale: float, vocab: int, max_len: int,
                  seed: int) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    pairs = trace_lengths("sharegpt")
    out, t = [], 0.0
    for i in range(n):
        p, o = rng.choice(pairs)
        p = max(4, min(int(p * scale), max_len // 2))
        o = max(1, min(int(o * scale), max_len - p))
        ids = [rng.randrange(100, vocab) for _ in range(p)]
        out.append(WorkloadRequest(f"r{i}", t, ids, o))
        t += rng.expovariate(rate)
    return out


def serve(engine: LLMEngine, workload: list[WorkloadRequest]) -> tuple[float, set[int]]:
    """Run the workload in real time; returns the start time and the steps after which the
    engine sat idle waiting for an arrival."""
    idle_after: set[int] = set()
    start = engine.clock()
    i, n = 0, len(workload)
    while i < n or engine.has_unfinished_requests():
        now = engine.clock() - start
        while i < n and workload[i].arrival_time <= now:
            w = workload[i]
            params = SamplingParams(temperature=0.0, max_tokens=w.output_len, ignore_eos=True)
            engine.add_request(w.request_id, list(w.prompt_token_ids), params,
                               arrival_time=start + w.arrival_time)
            i += 1
        if engine.has_unfinished_requests():
            engine.step()
        elif i < n:
            rec = engine.scheduler.recorder
            if rec is not None and rec.records:
                idle_after.add(rec.records[-1].step)
            time.sleep(max(0.0, workload[i].arrival_time - (engine.clock() - start)))
    return start, idle_after


def make_engine(args: argparse.Namespace, recorder: StepRecorder,
                cache: CacheConfig | None = None) -> LLMEngine:
    """A fresh torch engine with the benchmark's knobs, recording every step; with as many
    device KV blocks as ``cache`` when given (host blocks follow from the same swap space)."""
    return LLMEngine.from_args(EngineArgs(
        model=args.model, device=args.device, dtype=args.dtype, seed=args.seed,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        num_gpu_blocks=None if cache is None else cache.num_gpu_blocks,
    ), recorder=recorder)


def run_profile(args: argparse.Namespace, path: Path) -> None:
    """``kvloop profile`` of the served model and knobs, written to ``path``."""
    argv = ["profile", "--model", args.model, "-o", str(path),
            "--dtype", args.dtype, "--max-num-batched-tokens",
            str(args.max_num_batched_tokens), "--max-num-seqs", str(args.max_num_seqs),
            *(["--device", args.device] if args.device else []),
            *args.profile_args.split()]
    if kvloop_main(argv) != 0:
        raise SystemExit("kvloop profile failed")


def mean_calibration(first: Calibration, second: Calibration) -> Calibration:
    """A calibration fitted to the mean of two profiles' timings of the same items."""
    a, b = first.measurements, second.measurements
    merged = dict(a, bandwidth=(a["bandwidth"] + b["bandwidth"]) / 2)
    for f in fields(Measurements):
        xs, ys = a.get(f.name), b.get(f.name)
        if not isinstance(xs, list):
            continue
        if len(xs) != len(ys):
            raise SystemExit(f"the two profiles measured different {f.name}")
        pairs = list(zip(xs, ys, strict=True))
        if f.name == "runner_steps":
            merged[f.name] = [{**x, "s": (x["s"] + y["s"]) / 2} for x, y in pairs]
            same = all({**x, "s": 0} == {**y, "s": 0} for x, y in pairs)
        else:
            merged[f.name] = [[*x[:-1], (x[-1] + y[-1]) / 2] for x, y in pairs]
            same = all(list(x[:-1]) == list(y[:-1]) for x, y in pairs)
        if not same:
            raise SystemExit(f"the two profiles measured different {f.name}")
    return fit_calibration(Measurements(**merged), first.model, block_size=first.block_size,
                           num_gpu_blocks=first.num_gpu_blocks,
                           device_memory=first.hardware.mem_bytes, created=second.created)


def errors_pct(measured: dict, other: dict) -> dict[str, float]:
    """``other`` against ``measured`` in % for the means and medians of ``METRICS``, by
    name (``"ttft mean"``, ...)."""
    return {f"{n} {q}": (other[n][q] / measured[n][q] - 1) * 100
            for n in METRICS for q in ("mean", "p50")}


def worst_error(measured: dict, simulated: dict) -> float:
    """The largest |error| in % over the means and medians of ``METRICS``."""
    return max(abs(e) for e in errors_pct(measured, simulated).values())


def free_device_cache() -> None:
    """Hand CUDA's cached blocks back, so that the next engine sees them free."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reference_step(engine: LLMEngine) -> float:
    """Seconds of the runner's forward pass at REFERENCE_TOKENS tokens without attention
    (what ``kvloop profile`` tabulates), timed now."""
    import torch

    from kvloop.executor.torch.profiler import Profiler, ProfileSettings

    prof = Profiler(engine.executor, ProfileSettings(budget_s=1.0, min_runs=5))
    with torch.inference_mode():
        return prof.token_work(REFERENCE_TOKENS)


def step_errors(
    records, cost: CostModel, idle_after: set[int], block_size: int
) -> dict[str, list[tuple[float, float]]]:
    """(simulated, measured) seconds of every step, by step kind."""
    out: dict[str, list[tuple[float, float]]] = {"all": [], "decode": [], "mixed": [],
                                                  "prefill": []}
    for rec, nxt in itertools.pairwise(records):
        if rec.step in idle_after or not rec.scheduled:
            continue
        num_decodes, context, chunks, swapped = record_key(rec)
        predicted = cost.step_time(num_decodes, context, chunks, swapped, block_size=block_size)
        pair = (predicted, nxt.time_s - rec.time_s)
        kind = "decode" if not chunks else "prefill" if not num_decodes else "mixed"
        out["all"].append(pair)
        out[kind].append(pair)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=100, help="(default: %(default)s)")
    ap.add_argument("--request-rate", type=float, default=1.5,
                    help="Poisson arrivals per second (default: %(default)s)")
    ap.add_argument("--scale", type=float, default=0.125,
                    help="multiply the ShareGPT lengths (default: %(default)s)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calibration", type=Path, default=None,
                    help="reuse a `kvloop profile` file instead of profiling first (each "
                    "run prints where its own profile was written); not with --profile-twice")
    ap.add_argument("--profile-args", default="",
                    help="extra `kvloop profile` flags, e.g. --profile-args=--quick")
    ap.add_argument("--profile-twice", action="store_true",
                    help="profile again after serving and calibrate on the mean of both")
    ap.add_argument("--serve-twice", action="store_true",
                    help="serve the same requests again and print how far the two real runs "
                    "are apart (the noise floor of the comparison)")
    ap.add_argument("--trace-out", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    cal_path = args.calibration
    t0 = time.perf_counter()
    if args.profile_twice and cal_path is not None:
        raise SystemExit("--profile-twice profiles here: it takes no --calibration")
    if cal_path is None:
        cal_path = Path(tempfile.mkdtemp()) / "calibration.json"
        run_profile(args, cal_path)
    profile_s = time.perf_counter() - t0
    cal = Calibration.load(cal_path)

    recorder = StepRecorder()
    engine = make_engine(args, recorder)
    sched_cfg, cache_cfg = engine.scheduler.config, engine.scheduler.cache_config
    workload = make_workload(args.num_requests, args.request_rate, args.scale,
                             engine.limits.vocab_size or 1000, sched_cfg.max_model_len, args.seed)
    print(f"serving {len(workload)} requests at {args.request_rate} req/s "
          f"(prompts mean {statistics.fmean(len(w.prompt_token_ids) for w in workload):.0f}, "
          f"outputs mean {statistics.fmean(w.output_len for w in workload):.0f} tokens) on "
          f"{cal.device_name}", file=sys.stderr)
    before = reference_step(engine)
    t1 = time.perf_counter()
    _, idle_after = serve(engine, workload)
    serve_s = time.perf_counter() - t1
    after = reference_step(engine)
    records = recorder.records
    measured = summarize_requests(reconstruct_requests(records).values())
    rerun = None
    if args.serve_twice:
        # NOTE: a fresh engine (the first one's prefix cache holds these very prompts) with
        # the same KV pool, warmed up as the first was; the first is freed before it, or on
        # a GPU the second would size its pool from what the first left.
        del engine
        gc.collect()
        free_device_cache()
        again = StepRecorder()
        second = make_engine(args, again, cache_cfg)
        reference_step(second)
        serve(second, workload)
        rerun = summarize_requests(reconstruct_requests(again.records).values())
        del second
    if args.trace_out:
        with args.trace_out.open("w") as f:
            for rec in records:
                f.write(rec.to_json() + "\n")
    alone = None
    if args.profile_twice:
        after_path = cal_path.with_name("calibration-after.json")
        run_profile(args, after_path)
        first = cal
        cal = mean_calibration(first, Calibration.load(after_path))
        cal_path = cal_path.with_name("calibration-mean.json")
        cal.save(cal_path)
        alone = worst_error(measured, simulate(workload, sched_cfg, cache_cfg,
                                               first.cost_model()).metrics)

    cost = cal.cost_model()
    sim = simulate(workload, sched_cfg, cache_cfg, cost)
    simulated = sim.metrics
    errors = step_errors(records, cost, idle_after, cache_cfg.block_size)
    replay = MeasuredSteps(records, idle_after=idle_after, fallback=cost)
    loop_alone = worst_error(measured, simulate(workload, sched_cfg, cache_cfg, replay).metrics)

    print(f"\nkvloop simulate vs kvloop's torch engine: {cal.model.name} ({cal.dtype}) on "
          f"{cal.device_name}")
    print(f"{len(workload)} requests, {len(records)} steps; profile {profile_s:.0f} s, real "
          f"run {serve_s:.0f} s, simulation {sim.wall_time_s:.2f} s\n")
    header = f"{'metric':<14}{'measured':>11}{'simulated':>11}{'error':>9}"
    print(header)
    print("-" * len(header))
    rows = []
    for name in METRICS:
        for q in QUANTILES:
            a, b = measured[name][q], simulated[name][q]
            err = (b / a - 1) * 100
            rows.append({"metric": name, "quantile": q, "measured_s": a, "simulated_s": b,
                         "error_pct": err})
            scale, unit = (1e3, "ms") if name == "tpot" else (1, "s")
            print(f"{f'{name.upper()} {q} ({unit})':<14}{a * scale:11.3f}{b * scale:11.3f}"
                  f"{err:+8.1f}%")
    worst = worst_error(measured, simulated)
    print(f"\nworst mean/median error {worst:.1f}% (target 10%, goal 5%)")
    if alone is not None:
        print(f"(calibrated on the mean of the profiles before and after serving; with the "
              f"profile before serving alone: {alone:.1f}%)")
    print(f"with the served run's own step times instead of the cost model (the loop's error "
          f"alone): {loop_alone:.1f}% ({replay.hits} batches as served, {replay.misses} "
          "costed by the model)")
    if rerun is not None:
        print(f"the same requests served again right after, second run against the first "
              f"(+: the second took longer; this machine's run-to-run noise): worst "
              f"{worst_error(measured, rerun):.1f}%; "
              + ", ".join(f"{k} {v:+.1f}%" for k, v in errors_pct(measured, rerun).items()))
    ref = cal.tables.token_time(REFERENCE_TOKENS)
    print(f"\nmachine speed: reference forward pass ({REFERENCE_TOKENS} tokens) "
          f"{ref * 1e3:.1f} ms in the profile, {before * 1e3:.1f} ms before serving "
          f"({before / ref - 1:+.1%}), {after * 1e3:.1f} ms after ({after / ref - 1:+.1%})")
    print("\nstep time, simulated vs measured (same batch, step by step):")
    print(f"{'steps':<9}{'n':>6}{'median':>9}{'p10':>9}{'p90':>9}{'mean |err|':>12}"
          f"{'total':>9}")
    step_rows = {}
    for kind, pairs in errors.items():
        if not pairs:
            continue
        e = sorted(p / m - 1 for p, m in pairs)
        total = sum(p for p, _ in pairs) / sum(m for _, m in pairs) - 1
        step_rows[kind] = {"n": len(e), "median": percentile(e, 50), "p10": percentile(e, 10),
                           "p90": percentile(e, 90),
                           "mean_abs": statistics.fmean(abs(x) for x in e), "total": total}
        r = step_rows[kind]
        print(f"{kind:<9}{r['n']:>6}{r['median']:+9.1%}{r['p10']:+9.1%}{r['p90']:+9.1%}"
              f"{r['mean_abs']:12.1%}{total:+9.1%}")
    print("(total: the steps' simulated time over their measured time, minus 1)")
    if args.json:
        args.json.write_text(json.dumps({
            "device": cal.device_name, "rows": rows, "steps": step_rows,
            "num_requests": len(workload), "request_rate": args.request_rate,
            "scale": args.scale, "calibration": str(cal_path),
            "reference_step_s": {"profile": ref, "before": before, "after": after},
            "worst_error_first_profile_alone_pct": alone,
            "worst_error_measured_step_times_pct": loop_alone,
            "served_again_pct": rerun and errors_pct(measured, rerun),
        }, indent=1))


if __name__ == "__main__":
    main()
