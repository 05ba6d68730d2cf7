"""The prefix cache's host tier and queue-aware eviction, simulated on the shipped traces.

For one model on one GPU preset and a shipped trace at a rate scale, runs the simulator with
plain LRU and no host tier (the baseline), queue-aware eviction, and a host tier of
``--offload-gib`` (write-back with the cost model's load-or-recompute choice, write-through,
and always-recompute), and prints per configuration: prefix hit rate (device + host),
device and host hits, prompt tokens recomputed although an earlier request had computed them
(against an unbounded cache), GiB moved each way, TTFT p50 and mean, and the simulator's
speed. ``--eviction-traces`` compares LRU and queue-aware device hit rates on every shipped
trace instead.

    python benchmarks/kv_offload.py [--trace mooncake] [--rate-scale 0.5] [--offload-gib 200]
        [--model llama-3.1-8b] [--gpu h100] [--num-requests N] [--eviction-traces]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Any

from kvloop.cli.simulate import build_configs
from kvloop.engine.args import EngineArgs
from kvloop.executor.simulated import CostModel, get_hardware_spec, get_model_spec
from kvloop.sim.driver import simulate
from kvloop.sim.kv_offload import load_costs, offload_summary, prefix_reuse
from kvloop.sim.traces import SHIPPED_TRACES, load_trace

GIB = 1 << 30


def run(trace: str, rate_scale: float, num_requests: int | None, model_name: str,
        gpu: str, **engine: Any) -> dict[str, Any]:
    model, hw = get_model_spec(model_name), get_hardware_spec(gpu)
    cost = CostModel(model, hw)
    ea = EngineArgs(max_num_batched_tokens=8192, **engine)
    sched, cache = build_configs(ea, model, hw, 1)
    if cache.kv_offload_blocks:
        per_block, latency, per_token = load_costs(cost, cache.block_size)
        cache = replace(cache, kv_load_s_per_block=per_block, kv_load_latency_s=latency,
                        kv_recompute_s_per_token=per_token)
    workload = load_trace(trace, rate_scale=rate_scale, num_requests=num_requests)
    workload = [w for w in workload
                if len(w.prompt_token_ids) + w.output_len <= sched.max_model_len]
    start = time.perf_counter()
    res = simulate(workload, sched, cache, cost)
    wall = time.perf_counter() - start
    m, s = res.metrics, res.metrics["scheduler"]
    bs = cache.block_size
    unbounded = prefix_reuse(res.requests, bs)
    row = {
        "hit_rate": s["prefix_cache_hit_rate"],
        "ttft_p50": m["ttft"]["p50"], "ttft_mean": m["ttft"]["mean"],
        "recomputed": max(0, unbounded - s["prefix_cache_hits"]),
        "speed": m["duration"] / wall if wall else 0.0, "wall": wall,
        "device_hits": s["prefix_cache_hits"] // bs, "host_hits": 0,
        "gib_in": 0.0, "gib_out": 0.0, "host_recomputed": 0,
    }
    kv = s.get("kv_offload")
    if kv is not None:
        kv = offload_summary(kv, res.requests, bs, model.kv_block_bytes(bs))
        row.update(device_hits=s["prefix_cache_hits"] // bs - kv["host_hit_blocks"],
                   host_hits=kv["host_hit_blocks"], gib_in=kv["bytes_loaded"] / GIB,
                   gib_out=kv["bytes_stored"] / GIB, host_recomputed=kv["host_recomputed_blocks"])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="mooncake")
    ap.add_argument("--rate-scale", type=float, default=0.5)
    ap.add_argument("--offload-gib", type=float, default=200.0)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--eviction-traces", action="store_true")
    args = ap.parse_args()
    common = (args.rate_scale, args.num_requests, args.model, args.gpu)
    if args.eviction_traces:
        print(f"{'trace':<12}{'LRU hit':>10}{'queue-aware':>13}{'TTFT p50 LRU':>15}"
              f"{'queue-aware':>13}")
        for trace in SHIPPED_TRACES:
            a = run(trace, *common)
            b = run(trace, *common, kv_eviction="queue-aware")
            print(f"{trace:<12}{100 * a['hit_rate']:>9.2f}%{100 * b['hit_rate']:>12.2f}%"
                  f"{a['ttft_p50']:>14.3f}s{b['ttft_p50']:>12.3f}s")
        return
    configs = {
        "LRU, no host tier": {},
        "queue-aware, no host tier": {"kv_eviction": "queue-aware"},
        "host tier, write-back": {"kv_offload_space": args.offload_gib},
        "host tier, write-through": {"kv_offload_space": args.offload_gib,
                                     "kv_offload_write_policy": "write_through"},
        "host tier + queue-aware": {"kv_offload_space": args.offload_gib,
                                    "kv_eviction": "queue-aware"},
        "host tier, always recompute": {"kv_offload_space": args.offload_gib,
                                        "kv_offload_load": "recompute"},
    }
    print(f"{args.trace} x{args.rate_scale}, {args.model} on {args.gpu}, host tier "
          f"{args.offload_gib:g} GiB")
    head = (f"{'configuration':<30}{'hit':>7}{'dev blk':>9}{'host blk':>10}{'recomp tok':>12}"
            f"{'in GiB':>8}{'out GiB':>9}{'TTFT p50':>10}{'mean':>8}{'speed':>8}")
    print(head)
    for name, engine in configs.items():
        r = run(args.trace, *common, **engine)
        print(f"{name:<30}{100 * r['hit_rate']:>6.1f}%{r['device_hits']:>9}{r['host_hits']:>10}"
              f"{r['recomputed']:>12}{r['gib_in']:>8.1f}{r['gib_out']:>9.1f}"
              f"{r['ttft_p50']:>9.2f}s{r['ttft_mean']:>7.2f}s{r['speed']:>7.0f}x")


if __name__ == "__main__":
    main()
