"""The length-aware and fair policies on the real engine, counted in engine steps.

``LLMEngine`` with the default model on CPU, every request queued at step 0, few seats
(``--max-num-seqs``), so the waiting queue's order decides who runs when. Figures are in
steps, not seconds, so a busy machine changes how long the run takes but not what it
reports. Per policy:

- mean and p99 completion step of the requests (e2e in steps: all arrive at step 0);
- the service gap between tenants (VTC's cost: prompt tokens x 1 when the first token
  comes, output tokens x 2) from step 0 while every tenant still has requests waiting for
  their first token (``--window N``: the largest over windows of N steps instead), and
  Jain's index over the tenants' service there;
- the history predictor's Kendall tau where the policy has one.

Requests: ``--requests`` prompts of random token ids (16-160 tokens), ``max_tokens`` drawn
from 4-64 (``ignore_eos``), tenants ``t0`` 60% and ``t1``..``t4`` 10% each, seeded.

    python benchmarks/policies_engine_steps.py [--requests 32] [--max-num-seqs 4]
        [--policies fcfs,sjf,sjf-oracle,mlfq,fair,balanced] [--window 0] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from scipy.stats import kendalltau

from kvloop.engine.args import EngineArgs
from kvloop.engine.llm_engine import LLMEngine
from kvloop.sampling_params import SamplingParams

CONFIGS: dict[str, dict[str, Any]] = {
    "fcfs": {"scheduling_policy": "fcfs"},
    "sjf": {"scheduling_policy": "sjf", "length_predictor": "history"},
    "sjf-oracle": {"scheduling_policy": "sjf", "length_predictor": "oracle"},
    "mlfq": {"scheduling_policy": "mlfq"},
    "fair": {"scheduling_policy": "fair"},
    "balanced": {"scheduling_policy": "balanced", "length_predictor": "history",
                 "slo_ttft": 600.0},
}
TENANTS = ["t0"] * 6 + ["t1", "t2", "t3", "t4"]


def workload(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"rid": f"r{i}", "prompt": [rng.randrange(100, 20000)
                                        for _ in range(rng.randint(16, 160))],
             "max_tokens": rng.choice([4, 8, 16, 32, 64]), "tenant": rng.choice(TENANTS)}
            for i in range(n)]


def run(label: str, work: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    ea = EngineArgs(model="default", max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=256, num_gpu_blocks=args.num_gpu_blocks,
                    **CONFIGS[label])
    engine = LLMEngine.from_args(ea)
    by_id = {w["rid"]: w for w in work}
    for w in work:
        engine.add_request(w["rid"], w["prompt"], SamplingParams(
            max_tokens=w["max_tokens"], ignore_eos=True), tenant=w["tenant"])
    step, done, seen = 0, {}, {}
    per_step: list[dict[str, float]] = []
    waiting_left = {t: sum(1 for w in work if w["tenant"] == t) for t in set(TENANTS)}
    all_backlogged: list[bool] = []
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        step += 1
        served: dict[str, float] = {}
        for o in outs:
            w = by_id[o.request_id]
            n = o.num_output_tokens
            new = n - seen.get(o.request_id, 0)
            if new > 0:
                units = 2.0 * new + (len(w["prompt"]) if o.request_id not in seen else 0)
                served[w["tenant"]] = served.get(w["tenant"], 0.0) + units
                if o.request_id not in seen:
                    waiting_left[w["tenant"]] -= 1
                seen[o.request_id] = n
            if o.finished:
                done[o.request_id] = step
        per_step.append(served)
        all_backlogged.append(all(v > 0 for v in waiting_left.values()))
    wall = time.perf_counter() - started
    steps = sorted(done.values())
    gaps, jains = [], []
    span = all_backlogged.index(False) if False in all_backlogged else len(all_backlogged)
    window = args.window or span
    for i in range(0, span - window + 1, window) if window else ():
        xs = [sum(s.get(t, 0.0) for s in per_step[i:i + window]) for t in sorted(set(TENANTS))]
        gaps.append(max(xs) - min(xs))
        sq = sum(x * x for x in xs)
        jains.append(sum(xs) ** 2 / (len(xs) * sq) if sq else 1.0)
    policy = engine.scheduler.policy
    pairs = getattr(getattr(policy, "predictor", None), "pairs", None)
    tau = None
    if pairs and len({p for p, _ in pairs}) > 1:  # NOTE: constant predictions have no tau
        tau = float(kendalltau(*zip(*pairs, strict=True)).statistic)
    return {"policy": label, "steps": step, "e2e_steps_mean": sum(steps) / len(steps),
            "e2e_steps_p99": steps[min(len(steps) - 1, int(0.99 * len(steps)))],
            "windows": len(gaps), "max_gap": max(gaps, default=None),
            "jain": sum(jains) / len(jains) if jains else None, "tau": tau, "wall_s": wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--num-gpu-blocks", type=int, default=128)
    p.add_argument("--window", type=int, default=0,
                   help="steps per fairness window (0: the whole span in which every tenant "
                   "is backlogged)")
    p.add_argument("--policies", default=",".join(CONFIGS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    labels = [x for x in args.policies.split(",") if x]
    unknown = set(labels) - set(CONFIGS)
    if unknown:
        p.error(f"unknown policies {sorted(unknown)}; choose from {', '.join(CONFIGS)}")
    work = workload(args.requests, args.seed)
    rows = []
    for label in labels:
        rows.append(run(label, work, args))
        print(f"  {label}: {rows[-1]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    print(f"# {args.requests} requests at step 0, {args.max_num_seqs} seats, fairness over "
          + (f"windows of {args.window} steps" if args.window else "the all-backlogged span"))
    print("| policy | steps | e2e steps mean / p99 | VTC max gap (all backlogged) | Jain | "
          "windows | predictor tau |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        gap = "-" if r["max_gap"] is None else f"{r['max_gap']:.0f}"
        jain = "-" if r["jain"] is None else f"{r['jain']:.3f}"
        tau = "-" if r["tau"] is None else f"{r['tau']:.3f}"
        print(f"| {r['policy']} | {r['steps']} | {r['e2e_steps_mean']:.1f} / "
              f"{r['e2e_steps_p99']} | {gap} | {jain} | {r['windows']} | {tau} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
