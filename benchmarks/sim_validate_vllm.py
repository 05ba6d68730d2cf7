"""External validation: kvloop's simulator against a measured vLLM run it was not fitted to.

Replays the 300 ShareGPT requests of ``../shared/validation/vllm-rtxpro6000-llama-3.1-8b``
(vLLM 0.19, Llama-3.1-8B bf16, one RTX PRO 6000, 10 req/s) through kvloop's scheduler with
vLLM's settings from the run's ``meta.json`` (``max_num_seqs``, ``max_num_batched_tokens``,
TP) and vLLM V1's defaults otherwise (chunked prefill, prefix caching, 16-token blocks,
``gpu_memory_utilization`` 0.9), on the ``rtx-pro-6000`` preset (public specs; the
derived efficiency curve, no parameter fitted to this run) with the ``vllm`` engine
overhead. Prompts keep their real Llama-3 token ids, so prefix caching sees the real
reuse; each request arrives at the time vLLM queued it.

Prints measured vs simulated TTFT / TPOT / latency (mean, p50, p90, p99; SOURCE.md's
definitions, nearest-rank percentiles) with % errors, LLMServingSim's errors on the same
run for comparison, and the running / waiting counts per second against vLLM's time series.
The data stays in ``../shared``; nothing here ships in the package.

    python benchmarks/sim_validate_vllm.py [--data DIR] [--gpu rtx-pro-6000]
        [--engine-overhead vllm] [--json PATH] [--trace-out PATH]
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import statistics
from pathlib import Path

from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core.stats import StepRecorder
from kvloop.executor.simulated import (
    CostModel,
    engine_overhead,
    get_hardware_spec,
    get_model_spec,
    num_gpu_blocks,
)
from kvloop.sim.driver import simulate
from kvloop.sim.metrics import percentile
from kvloop.sim.traces import WorkloadRequest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared/validation/vllm-rtxpro6000-llama-3.1-8b"
QUANTILES = ("mean", "p50", "p90", "p99")


def load_run(data: Path) -> tuple[dict, list[dict], list[dict]]:
    meta = json.loads((data / "meta.json").read_text())
    with gzip.open(next(data.glob("workload_*.jsonl.gz")), "rt") as f:
        workload = [json.loads(line) for line in f]
    measured = [json.loads(line) for line in (data / "requests.jsonl").read_text().splitlines()]
    if len(workload) != len(measured):
        raise SystemExit("workload and measured requests differ in number")
    return meta, workload, measured


def stats(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {"mean": statistics.fmean(v), **{f"p{q}": percentile(v, q) for q in (50, 90, 99)}}


def measured_metrics(workload: list[dict], measured: list[dict]) -> dict[str, dict]:
    ttft, tpot, lat = [], [], []
    for w, m in zip(workload, measured, strict=True):
        ttft.append(m["first_token_ts"] - m["queued_ts"])
        lat.append(m["last_token_ts"] - m["queued_ts"])
        if w["output_toks"] > 1:
            tpot.append((m["last_token_ts"] - m["first_token_ts"]) / (w["output_toks"] - 1))
    return {"ttft": stats(ttft), "tpot": stats(tpot), "latency": stats(lat)}


def llmservingsim_errors(data: Path) -> dict[tuple[str, str], float]:
    """LLMServingSim's Diff% per (metric, quantile) from the run's summary file."""
    names = {"TTFT": "ttft", "TPOT": "tpot", "Latency": "latency"}
    quants = {"Mean": "mean", "Median": "p50", "P90": "p90", "P99": "p99"}
    out = {}
    for line in (data / "summary_vllm_vs_llmservingsim.txt").read_text().splitlines():
        parts = line.split()
        if len(parts) == 5 and parts[0] in names and parts[1] in quants:
            out[(names[parts[0]], quants[parts[1]])] = float(parts[4].rstrip("%"))
    return out


def per_second(records, horizon: int) -> list[tuple[float, float]]:
    """(running, waiting) at the last step that started in each second [t-1, t)."""
    out, i = [], 0
    last = (0.0, 0.0)
    for t in range(1, horizon + 1):
        while i < len(records) and records[i].time_s < t:
            last = (records[i].num_running, records[i].num_waiting)
            i += 1
        out.append(last)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=DATA,
                    help="the validation run's folder (default: %(default)s)")
    ap.add_argument("--gpu", default="rtx-pro-6000",
                    help="hardware preset or JSON spec (default: %(default)s)")
    ap.add_argument("--engine-overhead", default="vllm",
                    help="vllm, kvloop, none or seconds per step (default: %(default)s)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows as JSON")
    ap.add_argument("--trace-out", type=Path, default=None,
                    help="write the simulated step records (JSONL)")
    args = ap.parse_args()
    if not (args.data / "meta.json").is_file():
        raise SystemExit(f"no validation run at {args.data}: pass --data DIR (the folder "
                         "with meta.json, requests.jsonl and the workload)")

    meta, workload, measured = load_run(args.data)
    kw = meta["engine_kwargs"]
    model, hw = get_model_spec("llama-3.1-8b"), get_hardware_spec(args.gpu)
    tp = int(kw.get("tensor_parallel_size") or 1)
    q0 = min(m["queued_ts"] for m in measured)
    requests = [
        WorkloadRequest(m["request_id"], m["queued_ts"] - q0, w["input_tok_ids"], w["output_toks"])
        for w, m in zip(workload, measured, strict=True)
    ]
    sched = SchedulerConfig(
        max_num_batched_tokens=int(kw["max_num_batched_tokens"]),
        max_num_seqs=int(kw["max_num_seqs"]),
        max_model_len=int(kw.get("max_model_len") or model.max_position_embeddings),
    )
    cache = CacheConfig(
        block_size=16,
        num_gpu_blocks=num_gpu_blocks(model, hw, block_size=16, tp=tp,
                                      gpu_memory_utilization=0.9),
        enable_prefix_caching=True,
    )
    overhead = engine_overhead(args.engine_overhead)
    cost = CostModel(model, hw, tp=tp, overhead=overhead)
    recorder = StepRecorder()
    result = simulate(requests, sched, cache, cost, recorder=recorder)

    meas = measured_metrics(workload, measured)
    m = result.metrics  # the simulator's own summary: TTFT, TPOT (SOURCE.md's), e2e
    sim = {"ttft": m["ttft"], "tpot": m["tpot"], "latency": m["e2e"]}
    other = llmservingsim_errors(args.data)
    print(f"kvloop simulate vs measured vLLM {meta.get('vllm_version')}: {meta['model']} on "
          f"{hw.name} (efficiency: {cost.efficiency.source}); engine overhead: "
          f"{overhead.source}")
    print(f"{len(requests)} requests; max_num_seqs {sched.max_num_seqs}, "
          f"max_num_batched_tokens {sched.max_num_batched_tokens}, {cache.num_gpu_blocks} "
          f"KV blocks, prefix-cache hit rate "
          f"{result.metrics['scheduler']['prefix_cache_hit_rate']:.1%}\n")
    header = f"{'metric':<16}{'measured':>11}{'kvloop':>11}{'error':>9}{'LLMServingSim':>15}"
    print(header)
    print("-" * len(header))
    rows = []
    for name, unit, scale in (("ttft", "s", 1), ("tpot", "ms", 1e3), ("latency", "s", 1)):
        for q in QUANTILES:
            a, b = meas[name][q], sim[name][q]
            err = (b / a - 1) * 100
            o = other.get((name, q))
            rows.append({"metric": name, "quantile": q, "measured_s": a, "simulated_s": b,
                         "error_pct": err, "llmservingsim_error_pct": o})
            o_txt = f"{o:+.1f}%" if o is not None else "-"
            print(f"{name.upper() + ' ' + q + f' ({unit})':<16}{a * scale:11.3f}{b * scale:11.3f}"
                  f"{err:+8.1f}%{o_txt:>15}")
    duration_m = max(m["last_token_ts"] for m in measured) - q0
    sim_duration = result.metrics["duration"]
    print(f"\nrun duration: measured {duration_m:.1f} s, simulated {sim_duration:.1f} s "
          f"({sim_duration / duration_m - 1:+.1%})")
    ts_path = args.data / "timeseries.csv"
    if ts_path.exists():
        ts = list(csv.DictReader(ts_path.open()))
        sim_ts = per_second(recorder.records, len(ts))
        pairs = list(zip(ts, sim_ts, strict=True))
        d_run = statistics.fmean(abs(float(r["running"]) - s[0]) for r, s in pairs)
        d_wait = statistics.fmean(abs(float(r["waiting"]) - s[1]) for r, s in pairs)
        print(f"per-second counts vs vLLM's time series: mean |running diff| {d_run:.1f}, "
              f"mean |waiting diff| {d_wait:.1f} (peak waiting measured "
              f"{max(float(r['waiting']) for r in ts):.0f}, simulated "
              f"{max(s[1] for s in sim_ts):.0f})")
    if args.trace_out:
        with args.trace_out.open("w") as f:
            for rec in recorder.records:
                f.write(rec.to_json() + "\n")
    if args.json:
        args.json.write_text(json.dumps({"gpu": hw.name, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
