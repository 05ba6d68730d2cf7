"""``kvloop simulate``: replay a workload through the real scheduler on a virtual clock."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace

from kvloop.cli.args import add_scheduler_args, scheduler_args_from
from kvloop.cli.find_goodput import rate_range, run_find_goodput
from kvloop.cluster.routers import DEFAULT_ROUTER, ROUTERS, check_router
from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core.stats import StepRecorder
from kvloop.engine.args import EngineArgs
from kvloop.executor.simulated import (
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    CostModel,
    HardwareSpec,
    ModelSpec,
    engine_overhead,
    get_hardware_spec,
    get_model_spec,
    num_cpu_blocks,
    num_gpu_blocks,
)
from kvloop.executor.simulated.calibration import Calibration
from kvloop.executor.simulated.tables import StepTables
from kvloop.sim.cluster import format_cluster, simulate_cluster
from kvloop.sim.driver import simulate
from kvloop.sim.inference_perf import StagedWorkload, load_inference_perf
from kvloop.sim.kv_offload import load_costs, offload_rows, offload_summary
from kvloop.sim.load import load_note
from kvloop.sim.metrics import format_table, scheduler_rows
from kvloop.sim.stages import format_stages, stage_summaries
from kvloop.sim.traces import SHIPPED_TRACES, WorkloadRequest, load_trace
from kvloop.sim.workloads import (
    apply_priority_mix,
    apply_tenant_mix,
    parse_priority_mix,
    parse_tenant_mix,
    synthetic_workload,
)

SOURCE_DEFAULTS: dict[str, object] = {
    "trace": None, "num_requests": None, "request_rate": None, "rate_scale": 1.0,
    "burstiness": 1.0, "prompt_len": "trace:sharegpt", "output_len": "trace:sharegpt",
}
"""The flags that make a trace or synthetic workload (dest -> default): ``--workload`` is a
whole workload, so none of them may be set with it."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate serving a workload with a cost model",
        description="Run a workload through kvloop's scheduler with a roofline cost model.",
    )
    p.add_argument("--model", default=None,
                   help=f"preset ({', '.join(MODEL_PRESETS)}) or path to a HF config.json "
                   "(default: llama-3.1-8b, or the profiled model with --calibration)")
    p.add_argument("--gpu", default=None,
                   help=f"preset ({', '.join(HARDWARE_PRESETS)}) or a JSON hardware spec "
                   "(default: h100; not with --calibration)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="GPUs per replica (default: %(default)s)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="data-parallel ranks, each an engine with its own batch (vLLM's "
                   "flag): simulated as that many replicas behind --router; with "
                   "--enable-expert-parallel their MoE layers share the experts (default: 1)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="spread a mixture-of-experts model's experts whole over the "
                   "tensor x data parallel ranks, as vLLM's flag does (default: split every "
                   "expert by tensor parallelism)")
    p.add_argument("--engine-overhead", default=None, metavar="NAME|SECONDS",
                   help="per-step engine cost: vllm, kvloop, none, or seconds per step "
                   "(default: vllm, or with --calibration the measured one)")
    p.add_argument("--calibration", default=None, metavar="PATH",
                   help="a `kvloop profile` file: cost steps on the profiled device instead "
                   "of a --gpu preset (default: none)")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default=None, metavar="FILE",
                   help="an inference-perf config (YAML or JSON: data and load stages) to "
                   "simulate instead of a trace or synthetic workload; the summary gains one "
                   "row per stage (default: none)")
    w.add_argument("--trace", default=SOURCE_DEFAULTS["trace"],
                   help=f"shipped trace ({', '.join(SHIPPED_TRACES)}) or a trace file path "
                   "(default: none, a synthetic workload)")
    w.add_argument("--rate-scale", type=float, default=SOURCE_DEFAULTS["rate_scale"],
                   help="multiply the trace's arrival rate")
    w.add_argument("--num-requests", type=int, default=SOURCE_DEFAULTS["num_requests"],
                   help="requests (default: 1000 synthetic, or the whole trace)")
    w.add_argument("--request-rate", type=float, default=SOURCE_DEFAULTS["request_rate"],
                   help="Poisson/gamma arrivals in req/s (inf: all at once) (default: inf; "
                   "with --trace, the trace's own arrivals)")
    w.add_argument("--burstiness", type=float, default=SOURCE_DEFAULTS["burstiness"],
                   help="gamma shape; 1 = Poisson")
    w.add_argument("--prompt-len", default=SOURCE_DEFAULTS["prompt_len"],
                   help="synthetic prompt lengths: N, A:B or trace:NAME")
    w.add_argument("--output-len", default=SOURCE_DEFAULTS["output_len"],
                   help="synthetic output lengths: N, A:B or trace:NAME")
    w.add_argument("--priority-mix", default=None,
                   help="priorities with shares, e.g. 0:0.2,1:0.8 (default: none, all 0)")
    w.add_argument("--tenant-mix", default=None, metavar="SHARE,...",
                   help="give each request a tenant t0, t1, ... with these shares, e.g. "
                   "0.6,0.05,0.05 (seeded by --seed); the summary gains per-tenant rows and "
                   "Jain's fairness index (default: none)")
    w.add_argument("--seed", type=int, default=0,
                   help="seed of the synthetic or --workload workload and the mixes "
                   "(default: %(default)s)")
    w.add_argument("--find-goodput", type=rate_range, default=None, metavar="LO:HI",
                   help="search LO..HI requests/s (the workload's arrivals rescaled) for "
                   "DistServe's goodput: the highest rate at which 90%% of requests meet "
                   "every SLO given (--slo-ttft, --slo-tpot or both; default: off, one run "
                   "at the given rate)")
    c = p.add_argument_group("cluster")
    c.add_argument("--replicas", type=int, default=1,
                   help="replicas of this configuration behind one router, on one virtual "
                   "clock; above 1 the summary says of each line whether it is a cluster total, a "
                   "mean over replicas or a ratio, and gains a per-replica table")
    c.add_argument("--router", default=DEFAULT_ROUTER, metavar="NAME",
                   help=f"how arrivals pick a replica: {', '.join(ROUTERS)} (the routers "
                   "`kvloop serve --replicas` uses; no effect with one replica)")
    add_scheduler_args(p, max_num_batched_tokens=8192)
    o = p.add_argument_group("output")
    o.add_argument("--json", default=None, metavar="PATH",
                   help="write the metrics as JSON (default: none)")
    o.add_argument("--trace-out", default=None, metavar="PATH",
                   help="write one step record per line (JSONL) (default: none)")
    o.add_argument("--no-progress", action="store_true",
                   help="no progress bar while the simulation runs")
    p.set_defaults(func=run)


def build_configs(
    ea: EngineArgs, model: ModelSpec, hw: HardwareSpec, tp: int, ep: int = 1
) -> tuple[SchedulerConfig, CacheConfig]:
    """The configs ``EngineArgs`` derives for the engine; the simulated device supplies what
    the model runner would: the model's length limit and the KV block counts (``ep``: the
    ranks the experts are spread over)."""
    gpu_blocks = ea.num_gpu_blocks
    if gpu_blocks is None:
        gpu_blocks = num_gpu_blocks(model, hw, block_size=ea.block_size, tp=tp,
                                    gpu_memory_utilization=ea.gpu_memory_utilization, ep=ep)
    cpu_blocks = num_cpu_blocks(model, block_size=ea.block_size, tp=tp,
                                swap_space_gib=ea.swap_space)
    if ea.kv_offload_space < 0:
        raise ValueError(f"--kv-offload-space must be >= 0 GiB, got {ea.kv_offload_space}")
    offload = num_cpu_blocks(model, block_size=ea.block_size, tp=tp,
                             swap_space_gib=ea.kv_offload_space)
    max_len = ea.max_model_len or model.max_position_embeddings
    return ea.scheduler_config(max_len), ea.cache_config(gpu_blocks, cpu_blocks, offload)


def load_staged(args: argparse.Namespace) -> StagedWorkload | None:
    """The ``--workload`` file's workload (None without one); ``ValueError`` naming the flags
    that would also shape the workload, or the file and what is wrong in it."""
    if args.workload is None:
        return None
    given = [f"--{dest.replace('_', '-')}" for dest, default in SOURCE_DEFAULTS.items()
             if getattr(args, dest) != default]
    if given:
        raise ValueError(f"--workload sets the requests and their arrivals: not with "
                         f"{', '.join(given)}")
    return load_inference_perf(args.workload, seed=args.seed)


def build_workload(args: argparse.Namespace, staged: StagedWorkload | None = None
                   ) -> list[WorkloadRequest]:
    """The requests to simulate: ``staged``'s (``--workload``), a trace's or synthetic ones,
    with the priority and tenant mixes applied."""
    if staged is not None:
        workload = staged.requests
    elif args.trace is not None:
        workload = load_trace(
            args.trace, rate_scale=args.rate_scale, num_requests=args.num_requests,
            request_rate=args.request_rate, seed=args.seed,
        )
    else:
        workload = synthetic_workload(
            args.num_requests or 1000,
            request_rate=args.request_rate if args.request_rate is not None else math.inf,
            burstiness=args.burstiness,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            seed=args.seed,
        )
    if args.priority_mix:
        apply_priority_mix(workload, parse_priority_mix(args.priority_mix), seed=args.seed)
    if args.tenant_mix:
        apply_tenant_mix(workload, parse_tenant_mix(args.tenant_mix), seed=args.seed)
    return workload


def check_fits(workload, sched: SchedulerConfig, cache: CacheConfig) -> None:
    """Refuse a pool that cannot hold some request the model accepts; warn about requests
    longer than ``max_model_len`` (they fail, as a server would refuse them)."""
    pool_tokens = cache.num_gpu_blocks * cache.block_size
    sizes = [len(w.prompt_token_ids) + w.output_len for w in workload]
    too_long = sum(1 for n in sizes if n > sched.max_model_len)
    no_room = [n for n in sizes if pool_tokens < n <= sched.max_model_len]
    if no_room:
        raise ValueError(
            f"{len(no_room)} of {len(workload)} requests can never run: the largest needs "
            f"{max(no_room)} tokens but the KV pool holds {pool_tokens} "
            f"({cache.num_gpu_blocks} blocks of {cache.block_size}); raise --num-gpu-blocks, "
            "lower --max-model-len, or use --num-requests to cut the trace"
        )
    if too_long:
        print(
            f"kvloop: warning: {too_long} request{'s exceed' if too_long > 1 else ' exceeds'} "
            f"max_model_len "
            f"({sched.max_model_len}) and will fail; raise --max-model-len to run them",
            file=sys.stderr,
        )


def build_cost_model(
    args: argparse.Namespace, model: ModelSpec, cal: Calibration | None
) -> tuple[CostModel, str]:
    """The cost model the flags ask for, and a line saying what it rests on."""
    tp = args.tensor_parallel_size
    if cal is not None:
        if args.gpu is not None:
            raise ValueError("--gpu and --calibration both name the device: give one")
        if tp != 1 or args.data_parallel_size != 1 or args.enable_expert_parallel:
            raise ValueError("a calibration measures one device: --tensor-parallel-size "
                             "must be 1 with --calibration (and no --data-parallel-size or "
                             "--enable-expert-parallel)")
        overhead = (engine_overhead(args.engine_overhead) if args.engine_overhead
                    else cal.overhead)
        cost = cal.cost_model(model, tp, overhead)
        how = "measured tables" if cost.tables else f"curves fitted to it, {cal.dtype}"
        name = args.engine_overhead or "measured"
        return cost, (f"calibration {args.calibration}: {cal.device_name}, {how}; "
                      f"{name} engine overhead")
    hw = get_hardware_spec(args.gpu or "h100")
    overhead = engine_overhead(args.engine_overhead or "vllm")
    cost = CostModel(model, hw, tp=tp, overhead=overhead, dp=args.data_parallel_size,
                     expert_parallel=args.enable_expert_parallel)
    name = args.engine_overhead or "vllm"
    basis = cost.efficiency.source.split(" (")[0]
    if isinstance(hw.profile, str) and hw.profile not in (hw.name, "derived"):
        basis += f", at the {hw.name}'s own peak and bandwidth"
    return cost, f"{hw.name}, {basis}; {name} engine overhead"


def warn_beyond(tables: StepTables, sched: SchedulerConfig) -> None:
    """Say so when steps may be larger than the calibration measured (costs extrapolate)."""
    for what, limit, measured, flag in (
        ("tokens", sched.max_num_batched_tokens, tables.tokens[-1], "--max-num-batched-tokens"),
        ("requests", sched.max_num_seqs, tables.seqs[-1], "--max-num-seqs"),
    ):
        if limit > measured:
            print(f"kvloop: warning: steps of up to {limit} {what} ({flag}) but the calibration "
                  f"measured up to {measured}; larger steps are extrapolated", file=sys.stderr)


def check_cluster_args(args: argparse.Namespace) -> None:
    """Refuse a replica count below 1, an unknown router, or a step trace of many replicas
    (one JSONL stream records one scheduler's steps)."""
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.data_parallel_size > 1 and args.replicas > 1:
        raise ValueError("--data-parallel-size runs that many replicas already: not with "
                         "--replicas")
    check_router(args.router, "--router")
    if max(args.replicas, args.data_parallel_size) > 1 and args.trace_out:
        raise ValueError("--trace-out records one replica's steps: not with --replicas > 1")


def run(args: argparse.Namespace) -> int:
    check_cluster_args(args)
    staged = load_staged(args)
    cal = Calibration.load(args.calibration) if args.calibration is not None else None
    if args.model is None:
        model = cal.model if cal is not None else get_model_spec("llama-3.1-8b")
    else:
        model = get_model_spec(args.model)
    if cal is not None and model.dtype_bytes != cal.model.dtype_bytes:
        # NOTE: another model on the profiled device runs at the profiled dtype.
        model = replace(model, dtype_bytes=cal.model.dtype_bytes)
    cost, basis = build_cost_model(args, model, cal)
    hw = cost.hw
    tp = args.tensor_parallel_size
    ea = scheduler_args_from(args)
    if cal is not None and ea.num_gpu_blocks is None:
        # NOTE: the profiled runner's KV budget in bytes, in blocks of this model.
        budget = cal.num_gpu_blocks * cal.model.kv_block_bytes(cal.block_size)
        ea = replace(ea, num_gpu_blocks=max(1, budget // model.kv_block_bytes(ea.block_size, tp)))
    sched, cache = build_configs(ea, model, hw, tp, cost.ep)
    if cache.kv_offload_blocks:
        per_block, latency, per_token = load_costs(cost, cache.block_size)
        cache = replace(cache, kv_load_s_per_block=per_block, kv_load_latency_s=latency,
                        kv_recompute_s_per_token=per_token)
    if cost.tables is not None:
        warn_beyond(cost.tables, sched)
    workload = build_workload(args, staged)
    check_fits(workload, sched, cache)
    if args.find_goodput is not None:
        return run_find_goodput(args, workload, sched, cache, cost)
    progress = not args.no_progress and sys.stderr.isatty()
    replicas = max(args.replicas, args.data_parallel_size)
    if replicas > 1:
        result = simulate_cluster(workload, sched, cache, cost, num_replicas=replicas,
                                  router=args.router, progress=progress)
    else:
        sink = open(args.trace_out, "w") if args.trace_out else None  # noqa: SIM115
        try:
            recorder = StepRecorder(keep_in_memory=False, sink=sink) if sink else None
            result = simulate(workload, sched, cache, cost, recorder=recorder,
                              progress=progress)
        finally:
            if sink is not None:
                sink.close()
    m = result.metrics
    kv_offload = m["scheduler"].get("kv_offload")
    if kv_offload is not None:
        m["scheduler"]["kv_offload"] = offload_summary(
            kv_offload, result.requests, cache.block_size,
            model.kv_block_bytes(cache.block_size, tp))
    m["config"] = {
        "model": model.name, "gpu": hw.name, "tensor_parallel_size": args.tensor_parallel_size,
        "data_parallel_size": args.data_parallel_size,
        "expert_parallel": args.enable_expert_parallel,
        "cost_model": basis, "efficiency_source": cost.efficiency.source,
        "engine_overhead": vars(cost.overhead),
        "trace": args.trace, "workload": args.workload, "num_requests": len(workload),
        "scheduler": vars(sched) | {"prefill_chunk_cap": sched.prefill_chunk_cap},
        "cache": vars(cache),
    }
    if staged is not None:
        m["stages"] = stage_summaries(result.requests, staged)
        source = (f"{args.workload} (inference-perf, {staged.kind}, "
                  f"{len(staged.stages)} stage{'s' if len(staged.stages) > 1 else ''})")
    else:
        source = args.trace or "a synthetic workload"
    fleet = (f"{replicas} data-parallel ranks of " if args.data_parallel_size > 1 else
             f"{replicas} replicas of " if replicas > 1 else "")
    print(f"kvloop simulate: {fleet}{model.name} on {hw.name}{f' × {tp}' if tp > 1 else ''}, "
          f"{len(workload)} requests from {source}"
          f"{f', routed {args.router}' if replicas > 1 else ''}")
    print(f"cost model: {basis}: {cost.overhead.describe()}")
    if replicas > 1:
        print(format_cluster(m, result.wall_time_s))
    else:
        extra = scheduler_rows(m["scheduler"])
        if kv_offload is not None:
            extra |= offload_rows(m["scheduler"]["kv_offload"])
        extra["Simulation wall time (s)"] = f"{result.wall_time_s:.2f}"
        print(format_table(m, extra))
    if staged is not None:
        print(format_stages(m["stages"]))
    note = load_note(m["load"])
    if note:
        print(note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(m, f, indent=2, default=str)
    return 0
