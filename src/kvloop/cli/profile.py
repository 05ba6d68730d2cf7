"""``kvloop profile``: time the torch executor on this device and write a calibration file
that ``kvloop simulate --calibration`` uses instead of a GPU preset."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from kvloop.cli.args import SIZE_HELP, positive_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="measure this device and write a simulator calibration file",
        description="Time kvloop's torch executor piece by piece (GEMMs, attention, LM head, "
        "runner and engine overhead) on this device and fit the simulator's cost model to "
        "it. For the default model on 2 CPU cores, --quick takes 20-50 s; the full grid "
        "minutes (13 min measured on a busy 2-core machine). A busy machine "
        "takes longer and gives a noisy calibration, which kvloop profile warns about. "
        "Without a terminal it prints one line per measured item on stderr.",
    )
    p.add_argument("--model", default="default",
                   help="'default' (embedded SmolLM2-135M-Instruct), a HF folder or a .gguf "
                   "(default: default)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: auto)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=positive_size, default=None, metavar="SIZE",
                   help=f"KV cache size: {SIZE_HELP} (default: the engine's default budget)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="largest step measured (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="largest decode batch measured (default: %(default)s)")
    p.add_argument("--max-context", type=int, default=2048,
                   help="longest context measured (default: %(default)s)")
    p.add_argument("--token-budget", action="store_true",
                   help="only measure the engine's default token budget for this model, "
                   "--dtype and --quantization on this machine (seconds), and record it for "
                   "later starts of kvloop generate and serve; best on an idle machine")
    p.add_argument("--quantization", default=None, choices=["int4", "none"],
                   help="with --token-budget: the quantization the engine will run (default: "
                   "none)")
    p.add_argument("--quick", action="store_true",
                   help="fewer repeats and a smaller grid (512 tokens, 16 requests)")
    p.add_argument("-o", "--output", default="calibration.json", metavar="PATH",
                   help="where to write the calibration (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (on a terminal) or progress lines (otherwise)")
    p.set_defaults(func=run)


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _token_budget(args: argparse.Namespace) -> int:
    """``--token-budget``: measure, record, print the start-up line's figure."""
    from kvloop.engine.model_source import resolve_model
    from kvloop.executor.torch.budget import default_token_budget, record_path
    from kvloop.executor.torch.model_runner import TorchModelRunner

    runner = TorchModelRunner(
        str(resolve_model(args.model)), dtype=args.dtype, quantization=args.quantization,
        device=args.device, block_size=args.block_size, num_gpu_blocks=256 // args.block_size,
        max_num_batched_tokens=256, max_num_seqs=1)
    budget, why = default_token_budget(runner, measure=True)
    where = "" if runner.device.type == "cuda" else f"; recorded in {record_path(runner)}"
    print(f"kvloop profile: {budget} tokens per step ({why}){where}")
    return 0


def run(args: argparse.Namespace) -> int:
    for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_context"):
        _positive(f"--{name.replace('_', '-')}", getattr(args, name))
    if args.token_budget:
        return _token_budget(args)
    out = Path(args.output)
    if out.is_dir():
        raise ValueError(f"--output {out} is a directory; give a file path")
    from kvloop.engine.loop_timing import engine_loop_time
    from kvloop.engine.model_source import resolve_model
    from kvloop.engine.tokenizer import Tokenizer
    from kvloop.executor.simulated.fitting import fit_calibration
    from kvloop.executor.simulated.specs import ModelSpec
    from kvloop.executor.torch.model_runner import TorchModelRunner
    from kvloop.executor.torch.profiler import (
        NOISY_SPREAD,
        ProfileSettings,
        blocks_for,
        created_now,
        measure_bandwidth,
        new_measurements,
        plan,
    )

    settings = ProfileSettings(
        max_num_batched_tokens=min(args.max_num_batched_tokens, 512)
        if args.quick else args.max_num_batched_tokens,
        max_num_seqs=min(args.max_num_seqs, 16) if args.quick else args.max_num_seqs,
        max_context=min(args.max_context, 512) if args.quick else args.max_context,
        budget_s=0.05 if args.quick else 0.6,
        min_runs=2 if args.quick else 5,
        engine_steps=20 if args.quick else 60,
    )

    def say(msg: str) -> None:
        print(f"kvloop profile: {msg}", file=sys.stderr)

    started = time.perf_counter()
    path = resolve_model(args.model)
    say(f"loading {path}")
    cfg = json.loads((path / "config.json").read_text())
    need = blocks_for(settings, args.block_size, int(cfg.get("max_position_embeddings") or 2048))
    # NOTE: the KV pool the engine would have (measured on it, blocks scattered over it).
    runner = TorchModelRunner(
        str(path), dtype=args.dtype, device=args.device, block_size=args.block_size,
        num_gpu_blocks=None, kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
    )
    if runner.num_gpu_blocks < need:
        raise ValueError(
            f"the KV pool holds {runner.num_gpu_blocks} blocks but the measurements need "
            f"{need}: lower --max-context or --max-num-batched-tokens, or raise "
            "--kv-cache-memory"
        )
    try:
        tokenizer = Tokenizer(path)
    except (OSError, ValueError) as exc:  # a bare weights folder: no detokenizer cost
        say(f"no tokenizer ({exc}); the engine loop is timed without detokenization")
        tokenizer = None
    cfg["torch_dtype"] = str(runner.dtype).removeprefix("torch.")
    # NOTE: a .gguf converts to a folder named by a hash: call it by the file's name instead.
    name = ("SmolLM2-135M-Instruct" if args.model == "default"
            else Path(args.model).stem if args.model.lower().endswith(".gguf") else path.name)
    model = ModelSpec.from_hf_config(cfg, name, source=str(path / "config.json"))
    bandwidth, spread = measure_bandwidth(runner.device)
    m = new_measurements(runner, bandwidth)
    say(f"{m.device_name}, {m.dtype}: {bandwidth / 1e9:.1f} GB/s streaming copy "
        f"(repeats {spread:.0%} apart)")
    items = plan(runner, settings, m, lambda b: engine_loop_time(
        b, settings.engine_steps, tokenizer, runner.block_size))
    # NOTE: a bar on a terminal; in a log (stderr not a TTY) one plain line per item, so a
    # run of minutes is never silent.
    tty = sys.stderr.isatty()
    bar = tqdm(items, disable=args.no_progress or not tty, unit="item", leave=False)
    for i, (label, action) in enumerate(bar, 1):
        bar.set_description(label)
        if not tty and not args.no_progress:
            say(f"[{i}/{len(items)}] {label} ({time.perf_counter() - started:.0f} s)")
        action()
    bar.close()
    end_bandwidth, end_spread = measure_bandwidth(runner.device)
    drift = abs(end_bandwidth - bandwidth) / bandwidth
    cal = fit_calibration(m, model, block_size=args.block_size,
                          num_gpu_blocks=runner.num_gpu_blocks,
                          device_memory=runner.device_memory(), created=created_now())
    # NOTE: the overhead is what whole runner steps cost beyond the kernels timed apart; when
    # the machine stalled the steps but not the kernels (or the reverse), it swells to a
    # large part of the fastest step, which a quiet machine never shows.
    fastest = min((s["s"] for s in m.runner_steps), default=0.0)
    overhead = cal.overhead.step_s + cal.overhead.seq_s  # of a one-request step
    swollen = fastest > 0 and overhead > 0.5 * fastest
    if max(spread, end_spread, drift) > NOISY_SPREAD or swollen:
        why = (f"streaming-copy repeats were {spread:.0%} apart at the start and "
               f"{end_spread:.0%} at the end, and the bandwidth moved {drift:.0%} (quiet: a "
               "few %)")
        if swollen:
            why += (f"; the fitted overhead ({overhead * 1e3:.1f} ms per one-request step) is "
                    f"{overhead / fastest:.0%} of the fastest step measured")
        say(f"warning: this machine looks busy: {why}; the calibration is noisy: profile "
            "again on an idle machine")
    cal.save(out)
    eff = cal.hardware.efficiency()
    say(f"measured {len(items)} items in {time.perf_counter() - started:.0f} s; wrote {out}")
    print(f"device      {cal.device_name} ({cal.dtype})")
    print(f"peaks       {cal.hardware.peak_flops / 1e9:.1f} GFLOP/s, "
          f"{cal.hardware.mem_bandwidth / 1e9:.1f} GB/s (the best rates measured, anywhere)")
    print(f"gemm        {eff.gemm.compute_fraction:.2f} of peak compute, "
          f"{eff.gemm.memory_fraction:.2f} of bandwidth, sharpness {eff.gemm.sharpness:.2f}")
    a = eff.attention
    print(f"attention   prefill {a.prefill_fraction:.2f} of peak (half at "
          f"{a.prefill_half_context:.0f} tokens), decode {a.decode_fraction:.2f} of bandwidth "
          f"(+{a.decode_half_context:.0f} tokens per request), "
          f"{a.launch_s * 1e6:.0f} µs/layer/step, {a.chunk_s * 1e6:.0f} µs/layer/chunk")
    print(f"overhead    {cal.overhead.describe()} "
          "(runner and engine time beyond the measured kernels)")
    print(f"use it:     kvloop simulate --calibration {out} --max-num-batched-tokens "
          f"{settings.max_num_batched_tokens} --max-num-seqs {settings.max_num_seqs} ... "
          "(the largest steps measured)")
    return 0
