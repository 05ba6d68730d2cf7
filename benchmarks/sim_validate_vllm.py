"""The simulator against measured vLLM runs: every run we have, one table, one error summary.

Two sets from ``../shared/validation`` (read each SOURCE.md); nothing here ships in the
package:

* ``h100``: twelve vLLM 0.15.1 runs on H100 SXM driven by inference-perf (Llama-2-7B TP 1,
  CodeLlama-34B TP 2, Mixtral-8x7B TP 2; shared-prefix workloads, 1-2 stages each). Each
  run's workload is rebuilt with ``kvloop.sim.inference_perf`` from its own config (question
  lengths set so that a prompt has the measured mean length, chat framing included) and
  simulated with ``--gpu h100``, the run's tensor parallel size and vLLM's arguments
  (``max_num_seqs`` 128, ``max_num_batched_tokens`` 2048, ``max_model_len`` 4096, 16-token
  blocks, prefix caching and chunked prefill on, ``gpu_memory_utilization`` 0.9). Latencies
  are the client's: the ``vllm`` preset's frontend time counts.
* ``rtx``: 300 ShareGPT requests at 10 req/s with vLLM 0.19, Llama-3.1-8B, one RTX PRO 6000
  (public specs, the derived curve): each request arrives when vLLM queued it, with its real
  token ids. Its times are vLLM's own (from its queue), so the frontend time does not count.

Both use the ``vllm`` engine overhead. Per run and stage the table gives measured and
simulated TTFT mean / p50, e2e mean / p50 and decode time per token ((e2e mean - TTFT mean)
/ (median output - 1), on both sides), and whether each side is overloaded (measured: the
run says requests timed out; simulated: ``kvloop.sim.stages``' verdict, the last tenth of a
stage's arrivals waiting 10 s longer than the first; the rtx run by the same rule on both
sides). Then the mean absolute percentage error per metric over the stages neither side
overloaded and the rtx run (a finite burst whose queue drains, compared whatever the rule
says), the overloads predicted right, and the simulator's speed (simulated seconds per wall
second).

Two constants come from the ``h100`` runs. The ``vllm`` preset's ``frontend_s`` (vLLM's
server time outside the engine loop): the script refits it (the median over non-overloaded
stages of measured minus simulated TTFT p50) and reports each model's TTFT errors with the
constant fitted on the other two models only (leave-one-model-out); the shipped value is
``VLLM_FRONTEND_S`` in ``benchmarks/fit_cost_model.py``. The H100 GEMM curve's sharpness:
``--fit-sharpness`` simulates every h100 run at each value of a grid and reports the same
way (``sharpness_report``); the shipped value is ``SERVING_SHARPNESS`` there.

``--detail`` adds, for the ``rtx`` run, its percentiles next to LLMServingSim's errors on
the same run and the running / waiting counts against vLLM's time series.

    python benchmarks/sim_validate_vllm.py [--sets h100 rtx] [--runs NAME ...] [--detail]
        [--fit-sharpness] [--json PATH]
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import statistics
import time
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core.stats import StepRecorder
from kvloop.executor.simulated import (
    CostModel,
    HardwareSpec,
    ModelSpec,
    engine_overhead,
    get_hardware_spec,
    get_model_spec,
    num_gpu_blocks,
)
from kvloop.sim.driver import simulate
from kvloop.sim.inference_perf import Stage, workload_from_config
from kvloop.sim.metrics import percentile
from kvloop.sim.stages import OVERLOAD_WAIT_S, stage_summary
from kvloop.sim.traces import WorkloadRequest

ROOT = Path(__file__).resolve().parent.parent
VALIDATION = ROOT.parent / "shared/validation"
H100 = VALIDATION / "vllm-h100-inference-perf"
RTX = VALIDATION / "vllm-rtxpro6000-llama-3.1-8b"
METRICS = ("ttft_mean", "ttft_p50", "e2e_mean", "e2e_p50", "decode_per_token")
MS = {"ttft_mean", "ttft_p50", "decode_per_token"}


# -- the H100 development set -----------------------------------------------------------
def h100_run(path: Path, hw: HardwareSpec | None = None) -> dict[str, Any]:
    """One run of the H100 set simulated on ``hw`` (default: the ``h100`` preset)."""
    run = json.loads(path.read_text())
    cfg = json.loads((path.parent / run["model_config"]).read_text())
    model = ModelSpec.from_hf_config(cfg, run["model"])
    hw = hw if hw is not None else get_hardware_spec("h100")
    tp, va = int(run["tensor_parallel_size"]), run["vllm_args"]
    w = {k: v for k, v in run["workload"].items()
         if k not in ("generator", "arrivals", "stages", "ignore_eos")}  # the run's notes
    # NOTE: the measured prompt length (re-tokenised random text, chat framing) sets the
    # question's; the system prompt keeps its configured length.
    w["question_len"] = round(run["stages"][0]["prompt_len"]["mean"]) - w["system_prompt_len"]
    config = {"data": {"type": "shared_prefix", "shared_prefix": w},
              "load": {"type": "constant", "stages": run["workload"]["stages"]}}
    workload = workload_from_config(config, where=run["run"])
    sched = SchedulerConfig(max_num_batched_tokens=va["max_num_batched_tokens"],
                            max_num_seqs=va["max_num_seqs"], max_model_len=va["max_model_len"])
    cache = CacheConfig(block_size=16, enable_prefix_caching=True,
                        num_gpu_blocks=num_gpu_blocks(model, hw, block_size=16, tp=tp))
    cost = CostModel(model, hw, tp=tp, overhead=engine_overhead("vllm"))
    started = time.perf_counter()
    result = simulate(workload.requests, sched, cache, cost)
    wall = time.perf_counter() - started
    by_id = {r.request_id: r for r in result.requests}
    rows = []
    for k, (stage, measured) in enumerate(zip(workload.stages, run["stages"], strict=True)):
        reqs = [by_id[w.request_id] for w, s in zip(workload.requests, workload.stage_of,
                                                     strict=True) if s == k]
        out = measured["output_len"]["median"]
        rows.append({
            "run": run["run"], "model": run["run"].rsplit("-", 1)[0], "rate": stage.rate,
            "measured": {
                "ttft_mean": measured["ttft_s"]["mean"], "ttft_p50": measured["ttft_s"]["median"],
                "e2e_mean": measured["e2e_s"]["mean"], "e2e_p50": measured["e2e_s"]["median"],
                "decode_per_token": (measured["e2e_s"]["mean"] - measured["ttft_s"]["mean"])
                / (out - 1),
            },
            "measured_overloaded": measured["failed"] > 0,
            "simulated": stage_summary(stage, reqs, output_len=out),
            "frontend_counts": True,
        })
    return {"run": run["run"], "rows": rows, "wall_s": wall,
            "realtime_x": workload.stages[-1].end_s / wall, "requests": len(workload.requests)}


# -- the RTX PRO 6000 run ----------------------------------------------------------------
def rtx_load(data: Path) -> tuple[dict, list[dict], list[dict]]:
    meta = json.loads((data / "meta.json").read_text())
    with gzip.open(next(data.glob("workload_*.jsonl.gz")), "rt") as f:
        workload = [json.loads(line) for line in f]
    measured = [json.loads(line) for line in (data / "requests.jsonl").read_text().splitlines()]
    if len(workload) != len(measured):
        raise SystemExit("workload and measured requests differ in number")
    return meta, workload, measured


def rtx_run(data: Path) -> dict[str, Any]:
    meta, workload, measured = rtx_load(data)
    kw = meta["engine_kwargs"]
    model, hw = get_model_spec("llama-3.1-8b"), get_hardware_spec("rtx-pro-6000")
    tp = int(kw.get("tensor_parallel_size") or 1)
    q0 = min(m["queued_ts"] for m in measured)
    requests = [WorkloadRequest(m["request_id"], m["queued_ts"] - q0, w["input_tok_ids"],
                                w["output_toks"])
                for w, m in zip(workload, measured, strict=True)]
    sched = SchedulerConfig(max_num_batched_tokens=int(kw["max_num_batched_tokens"]),
                            max_num_seqs=int(kw["max_num_seqs"]),
                            max_model_len=int(kw.get("max_model_len")
                                              or model.max_position_embeddings))
    cache = CacheConfig(block_size=16, enable_prefix_caching=True,
                        num_gpu_blocks=num_gpu_blocks(model, hw, block_size=16, tp=tp))
    # NOTE: the run's times start at vLLM's queue: its frontend is outside them
    overhead = replace(engine_overhead("vllm"), frontend_s=0.0)
    recorder = StepRecorder()
    started = time.perf_counter()
    result = simulate(requests, sched, cache, CostModel(model, hw, tp=tp, overhead=overhead),
                      recorder=recorder)
    wall = time.perf_counter() - started
    ttft = [m["first_token_ts"] - m["queued_ts"] for m in measured]
    e2e = [m["last_token_ts"] - m["queued_ts"] for m in measured]
    out = percentile(sorted(w["output_toks"] for w in workload), 50)
    span = max(m["last_token_ts"] for m in measured) - q0
    stage = Stage(rate=len(requests) / (max(r.arrival_time for r in requests) or 1.0),
                  duration_s=max(r.arrival_time for r in requests), start_s=0.0)
    row = {
        "run": "rtx-pro-6000-llama-3.1-8b", "model": "llama-3.1-8b (rtx)", "rate": stage.rate,
        "measured": {"ttft_mean": statistics.fmean(ttft), "ttft_p50": percentile(sorted(ttft), 50),
                     "e2e_mean": statistics.fmean(e2e), "e2e_p50": percentile(sorted(e2e), 50),
                     "decode_per_token": (statistics.fmean(e2e) - statistics.fmean(ttft))
                     / (out - 1)},
        # NOTE: the same verdict as the simulated side's; a finite burst (its queue peaks
        # at ~100 and drains) is compared whatever it says
        "measured_overloaded": growth(ttft, [m["queued_ts"] for m in measured]) > OVERLOAD_WAIT_S,
        "simulated": stage_summary(stage, result.requests, output_len=out),
        "frontend_counts": False,
        "compare": True,
    }
    return {"run": row["run"], "rows": [row], "wall_s": wall, "realtime_x": span / wall,
            "requests": len(requests), "detail": (meta, workload, measured, result, recorder),
            "recorded": True}


def rtx_detail(data: Path, res: dict[str, Any]) -> None:
    """The RTX run's percentiles next to LLMServingSim's errors, and its time series."""
    meta, workload, measured, result, recorder = res["detail"]
    names = {"TTFT": "ttft", "TPOT": "tpot", "Latency": "e2e"}
    quants = {"Mean": "mean", "Median": "p50", "P90": "p90", "P99": "p99"}
    other = {}
    for line in (data / "summary_vllm_vs_llmservingsim.txt").read_text().splitlines():
        parts = line.split()
        if len(parts) == 5 and parts[0] in names and parts[1] in quants:
            other[(names[parts[0]], quants[parts[1]])] = float(parts[4].rstrip("%"))
    meas: dict[str, list[float]] = {"ttft": [], "tpot": [], "e2e": []}
    for w, m in zip(workload, measured, strict=True):
        meas["ttft"].append(m["first_token_ts"] - m["queued_ts"])
        meas["e2e"].append(m["last_token_ts"] - m["queued_ts"])
        if w["output_toks"] > 1:
            meas["tpot"].append((m["last_token_ts"] - m["first_token_ts"]) / (w["output_toks"] - 1))
    sim = result.metrics
    print(f"\nrtx detail (vLLM {meta.get('vllm_version')}): metric, measured, kvloop, error, "
          "LLMServingSim's error")
    for name in ("ttft", "tpot", "e2e"):
        v = sorted(meas[name])
        m = {"mean": statistics.fmean(v), **{f"p{q}": percentile(v, q) for q in (50, 90, 99)}}
        for q in ("mean", "p50", "p90", "p99"):
            a, b = m[q], sim[name][q]
            o = other.get((name, q))
            print(f"  {name} {q:4} {a:10.4f} {b:10.4f} {(b / a - 1) * 100:+6.1f}%  "
                  + (f"{o:+.1f}%" if o is not None else "-"))
    ts = list(csv.DictReader((data / "timeseries.csv").open()))
    records, out, i, last = recorder.records, [], 0, (0.0, 0.0)
    for t in range(1, len(ts) + 1):
        while i < len(records) and records[i].time_s < t:
            last = (records[i].num_running, records[i].num_waiting)
            i += 1
        out.append(last)
    pairs = list(zip(ts, out, strict=True))
    run_diff = statistics.fmean(abs(float(r["running"]) - s[0]) for r, s in pairs)
    wait_diff = statistics.fmean(abs(float(r["waiting"]) - s[1]) for r, s in pairs)
    print(f"  per-second counts vs vLLM's time series: mean |running diff| {run_diff:.1f}, "
          f"mean |waiting diff| {wait_diff:.1f}")


def growth(ttft: list[float], arrivals: list[float]) -> float:
    """Mean TTFT of the last tenth of arrivals minus the first tenth's (``kvloop.sim.stages``'
    overload measure)."""
    by_arrival = [t for _, t in sorted(zip(arrivals, ttft, strict=True))]
    tenth = max(1, len(by_arrival) // 10)
    return statistics.fmean(by_arrival[-tenth:]) - statistics.fmean(by_arrival[:tenth])


# -- the report --------------------------------------------------------------------------
def frontend_report(results: list[dict[str, Any]]) -> None:
    """The frontend constant refitted, and leave-one-model-out TTFT errors (module doc)."""
    shipped = engine_overhead("vllm").frontend_s
    residuals: dict[str, list[float]] = {}
    stages: dict[str, list[dict[str, Any]]] = {}
    for row in (r for res in results for r in res["rows"]):
        if row["measured_overloaded"] or row["simulated"]["overloaded"] or not row[
                "frontend_counts"]:
            continue
        # NOTE: the frontend time shifts every TTFT by the same amount (arrivals only move)
        bare = row["simulated"]["ttft_p50"] - shipped
        residuals.setdefault(row["model"], []).append(row["measured"]["ttft_p50"] - bare)
        stages.setdefault(row["model"], []).append(row)
    if len(residuals) < 2:
        return
    fitted = statistics.median(r for rs in residuals.values() for r in rs)
    print(f"frontend constant: shipped {shipped * 1e3:.1f} ms, refitted on every model "
          f"{fitted * 1e3:.1f} ms")
    for model in sorted(residuals):
        c = statistics.median(r for m, rs in residuals.items() if m != model for r in rs)
        errs: dict[str, list[float]] = {"ttft_mean": [], "ttft_p50": []}
        for row in stages[model]:
            for k, v in errs.items():
                v.append(abs((row["simulated"][k] - shipped + c) / row["measured"][k] - 1) * 100)
        print(f"  leave out {model}: constant {c * 1e3:.1f} ms from the others; its TTFT mean "
              f"MAPE {statistics.fmean(errs['ttft_mean']):.1f}%, p50 "
              f"{statistics.fmean(errs['ttft_p50']):.1f}%")


FIT_METRICS = ("e2e_mean", "decode_per_token")
"""What the H100 GEMM sharpness is fitted to (mean |error|): the step times it sets. TTFT's
level is the frontend constant's, refitted after it (``frontend_report``)."""
SHARPNESS_GRID = (1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0)
SHARPNESS_TIE_PP = 0.1
"""Errors within this many percentage points of the best are a tie, won by the softest
curve (the nearest to the profiles')."""


def sharpness_report(paths: list[Path], shipped_rows: list[dict[str, Any]]) -> None:
    """The H100 GEMM curve's sharpness refitted to the h100 runs: each model's mean |error|
    over ``FIT_METRICS`` and the stages neither side overloaded with the shipped curve, at
    every value of the grid (plus Vidur's profile fit and the shipped value), the value all
    models choose, and each model's errors at the value the other two choose
    (leave-one-model-out). The shipped value is ``SERVING_SHARPNESS`` in
    ``benchmarks/fit_cost_model.py``; ``shipped_rows`` are the runs' rows with it, already
    simulated."""
    base = get_hardware_spec("h100")
    shipped = base.efficiency()
    quality = json.loads(resources.files("kvloop.executor.simulated").joinpath(
        "data/gpu_profiles.json").read_text(encoding="utf-8"))["fit_quality"]["h100"]
    profile = quality.get("gemm_profile_sharpness", shipped.gemm.sharpness)
    grid = sorted({*SHARPNESS_GRID, profile, shipped.gemm.sharpness})
    rows: dict[float, list[dict[str, Any]]] = {shipped.gemm.sharpness: shipped_rows}
    for n in (v for v in grid if v != shipped.gemm.sharpness):
        hw = replace(base, profile=replace(shipped, gemm=replace(shipped.gemm, sharpness=n)))
        rows[n] = [r for p in paths for r in h100_run(p, hw)["rows"]]
    # NOTE: one set of stages for every value: those neither side overloaded as shipped
    kept = {(r["run"], r["rate"]) for r in rows[shipped.gemm.sharpness]
            if not r["measured_overloaded"] and not r["simulated"]["overloaded"]}
    errors: dict[float, dict[str, dict[str, list[float]]]] = {}
    for n in grid:
        by_model: dict[str, dict[str, list[float]]] = {}
        for row in (r for r in rows[n] if (r["run"], r["rate"]) in kept):
            errs = by_model.setdefault(row["model"], {k: [] for k in FIT_METRICS})
            for k in FIT_METRICS:
                errs[k].append(abs(row["simulated"][k] / row["measured"][k] - 1) * 100)
        errors[n] = by_model
    models = sorted(errors[shipped.gemm.sharpness])
    if not models:
        print("H100 GEMM sharpness: no stage in which neither side overloaded to fit it on")
        return

    def score(n: float, among: list[str]) -> float:
        return statistics.fmean(e for m in among for v in errors[n][m].values() for e in v)

    def fit(among: list[str]) -> float:
        best = min(score(n, among) for n in grid)
        return min(n for n in grid if score(n, among) <= best + SHARPNESS_TIE_PP)

    print(f"H100 GEMM sharpness (profile fit {profile:.2f}, shipped "
          f"{shipped.gemm.sharpness:.2f}): mean |error| of {', '.join(FIT_METRICS)} per model")
    print(f"{'s':>6}  " + "  ".join(f"{m:>24}" for m in models) + f"  {'all':>6}")
    for n in grid:
        print(f"{n:6.2f}  " + "  ".join(f"{score(n, [m]):23.1f}%" for m in models)
              + f"  {score(n, models):5.1f}%")
    print(f"  fitted on every model: {fit(models):.2f} (the softest within "
          f"{SHARPNESS_TIE_PP} points of the best)")
    for model in models if len(models) > 1 else ():
        others = [m for m in models if m != model]
        n = fit(others)
        held = errors[n][model]
        print(f"  leave out {model}: {n:.2f} from the others; its MAPE " + ", ".join(
            f"{k} {statistics.fmean(v):.1f}%" for k, v in held.items()))


def report(results: list[dict[str, Any]]) -> dict[str, float]:
    print(f"{'run':34}{'rate':>5}  {'TTFT mean':>17}  {'TTFT p50':>17}  {'e2e mean':>17}  "
          f"{'e2e p50':>17}  {'decode/token':>19}  overload")
    errors: dict[str, list[float]] = {m: [] for m in METRICS}
    hits = misses = 0
    for res in results:
        for row in res["rows"]:
            m, s = row["measured"], row["simulated"]
            mo, so = row["measured_overloaded"], bool(s["overloaded"])
            hits += mo == so
            misses += mo != so
            cells = []
            compared = row.get("compare", not mo and not so)
            for key in METRICS:
                err = (s[key] / m[key] - 1) * 100
                if compared:
                    errors[key].append(abs(err))
                unit = 1e3 if key in MS else 1
                text = f"{err:+5.0f}%" if abs(err) < 1e4 else "  big"
                cells.append(f"{m[key] * unit:7.1f}>{s[key] * unit:7.1f} {text}")
            flag = f"{'yes' if mo else 'no'}/{'yes' if so else 'no'}"
            print(f"{row['run']:34}{row['rate']:5.0f}  " + "  ".join(cells) + f"  {flag}")
    print("(ms for TTFT and decode/token, s for e2e; measured>simulated error; overload "
          "measured/simulated)")
    mape = {k: statistics.fmean(v) for k, v in errors.items() if v}
    rtx = ", and the rtx burst" if any(r.get("recorded") for r in results) else ""
    print(f"MAPE over the stages compared (neither side overloaded{rtx}): "
          + ", ".join(f"{k} {v:.1f}%" for k, v in mape.items()))
    print(f"overload right in {hits} of {hits + misses} stages")
    print("speed (simulated seconds per wall second): " + ", ".join(
        f"{r['run']} {r['realtime_x']:.0f}x" + (" (every step recorded)" if r.get("recorded")
                                               else "") for r in results))
    dev = [r["realtime_x"] for r in results if not r.get("recorded")]
    if dev:
        print(f"slowest development-set run: {min(dev):.0f}x real time")
    return mape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sets", nargs="+", default=["h100", "rtx"], choices=["h100", "rtx"])
    ap.add_argument("--runs", nargs="*", default=None, help="h100 run names (default: all)")
    ap.add_argument("--detail", action="store_true", help="the rtx run's percentiles and "
                    "time series")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--fit-sharpness", action="store_true", help="refit the H100 GEMM "
                    "sharpness to the h100 runs, with leave-one-model-out errors (slow)")
    args = ap.parse_args()
    results = []
    if "h100" in args.sets:
        paths = sorted(H100.glob("*.json"))
        if args.runs:
            paths = [p for p in paths if p.stem in args.runs]
        results += [h100_run(p) for p in paths]
    if "rtx" in args.sets:
        results.append(rtx_run(RTX))
    mape = report(results)
    frontend_report(results)
    if args.fit_sharpness:
        if "h100" in args.sets:
            sharpness_report(paths, [r for res in results[:len(paths)] for r in res["rows"]])
        else:
            print("--fit-sharpness fits the H100 curve to the h100 set: add --sets h100")
    if args.detail and "rtx" in args.sets:
        rtx_detail(RTX, results[-1])
    if args.json:
        for r in results:
            r.pop("detail", None)
        args.json.write_text(json.dumps({"runs": results, "mape": mape}, indent=1))


if __name__ == "__main__":
    main()
