"""Decode steps of the default model against their floor: streaming every weight once.

A decode step must read every weight once, so its time cannot be below
``weight bytes / read bandwidth``. The bandwidth is measured here (the best of several
full reads of a 1 GiB tensor with torch's threads, on transparent huge pages where the OS
offers them, as kvloop keeps a CPU model's weights) before and after each batch, whose floor
takes the faster of its two reads (a shared VM's bandwidth can move by 2x from one minute to
the next: the run ends with the range it read, and a warning when that range is wide), the
step time by running ``batch``
requests (``--prompt-len`` tokens, 128 by default, outputs forced to 64 tokens) through
``LLMEngine`` and
timing every step in which all of them decode. Printed per batch: the floor, the GEMM
time (every layer matrix and the LM head at that batch, best of 5: what the stock kernels
cost, the floor those kernels allow), the median decode step, step/floor, and tokens per
second. The target is a step/floor ratio <= 1.25. ``--profile`` adds where each
step's time goes (torch profiler self times: weight GEMMs, attention with the KV gather and
write, other ops, and host time outside any op).

    python benchmarks/decode_floor.py [--batches 1,8,32] [--model default] [--dtype auto]
        [--quantization int4] [--device cuda] [--prompt-len 128] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvloop.engine.args import EngineArgs
from kvloop.engine.llm_engine import LLMEngine
from kvloop.executor.torch.huge_pages import move_to_huge_pages
from kvloop.executor.torch.profiler import device_name
from kvloop.sampling_params import SamplingParams

GEMM_OPS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm",
            "mkldnn::_linear_pointwise", "aten::_weight_int4pack_mm_for_cpu",
            "kvloop::q4_linear", "kvloop::q8_linear", "kvloop::bf16_linear",
            "kvloop::f32_linear"}
ATTENTION_OPS = {"aten::_scaled_dot_product_flash_attention_for_cpu", "aten::index_select",
                 "aten::index_copy_", "kvloop::decode_attention"}

OUTPUT_LEN = 64
BANDWIDTH_SPREAD = 1.25  # the read bandwidth's max/min over a run above which it warns


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second of the fastest of ``repeats`` full reads (a sum) of ``nbytes``."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    move_to_huge_pages([x])  # NOTE: where kvloop keeps a CPU model's weights (CUDA: no-op)
    x.fill_(1.0)  # NOTE: touches every page before timing (after the move: one copy in RAM)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        x.sum()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def decode_steps(engine: LLMEngine, batch: int, seed: int, prompt_len: int) -> list[float]:
    """Seconds of every step in which all ``batch`` requests (``prompt_len``-token prompts)
    decode."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=OUTPUT_LEN, ignore_eos=True, temperature=0)
    vocab = engine.executor.model_config.vocab_size
    for _ in range(batch):
        ids = torch.randint(10, vocab - 10, (prompt_len,), generator=g).tolist()
        engine.add_request(None, {"prompt_token_ids": ids}, params)
    times = []
    while engine.has_unfinished_requests():
        running = engine.stats().num_running
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        sched = engine.scheduler.stats
        if running == batch and len(outs) == batch and all(
                len(o.new_token_ids) == 1 for o in outs) and sched.num_steps > 1:
            times.append(dt)
    return times


def gemm_time(engine: LLMEngine, batch: int) -> float:
    """Seconds of one pass over every layer matrix and the LM head at ``batch`` rows."""
    model = engine.executor.model
    hidden = model.config.hidden_size
    dtype, device = engine.executor.dtype, engine.executor.device
    inputs: dict[int, torch.Tensor] = {}
    mats = [m for layer in model.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    for m in mats:
        inputs.setdefault(m.in_features,
                          torch.randn(batch, m.in_features, dtype=dtype, device=device))
    x = torch.randn(batch, hidden, dtype=dtype, device=device)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(5):
            _sync(device)
            t = time.perf_counter()
            for m in mats:
                m(inputs[m.in_features])
            model.lm_head(x)
            _sync(device)
            best = min(best, time.perf_counter() - t)
    return best


def profile_shares(engine: LLMEngine, batch: int, prompt_len: int) -> str:
    """Shares of the decode steps' wall time: weight GEMMs, attention, other ops, host."""
    from torch.profiler import ProfilerActivity, profile

    # NOTE: CPU self times only: on CUDA they are launch costs, not the kernels' time.
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        decode_steps(engine, batch, seed=batch + 1, prompt_len=prompt_len)
        wall = time.perf_counter() - t
    shares = {"weight GEMMs": 0.0, "attention + KV gather/write": 0.0, "other ops": 0.0}
    for ev in prof.key_averages():
        key = ("weight GEMMs" if ev.key in GEMM_OPS else "attention + KV gather/write"
               if ev.key in ATTENTION_OPS else "other ops")
        shares[key] += ev.self_cpu_time_total / 1e6
    shares["host (Python, no op)"] = max(wall - sum(shares.values()), 0.0)
    return ", ".join(f"{k} {v / wall:.0%}" for k, v in shares.items())


def _engine(args: argparse.Namespace, batches: list[int]) -> LLMEngine:
    """The engine of the run: the model and dtype asked for, room for the largest batch."""
    return LLMEngine.from_args(EngineArgs(model=args.model, dtype=args.dtype,
                                          quantization=args.quantization, device=args.device,
                                          max_num_seqs=max(batches),
                                          max_num_batched_tokens=4096))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None, choices=["int4"])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--prompt-len", type=int, default=128,
                   help="tokens per prompt: the decode steps attend to this many and more")
    p.add_argument("--profile", action="store_true", help="print where each step's time goes")
    p.add_argument("--attention", default="auto", choices=["auto", "gather", "native", "flex"],
                   help="paged attention path: decodes read in place by kvloop's CPU kernel "
                        "(CPU default where it builds), gather the blocks, or read them in "
                        "place with FlexAttention (CUDA default)")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.prompt_len < 1:
        p.error("--prompt-len must be at least 1")
    if args.attention == "flex" and args.device != "cuda":
        p.error("--attention flex is a CUDA path: on CPU FlexAttention runs its eager "
                "reference, which scores every slot of the pool (kept for the tests only)")
    try:
        engine = _engine(args, batches)
    except ValueError as exc:
        p.error(str(exc))
    if args.attention == "native" and not engine.executor.native_attention:
        p.error("--attention native: kvloop's CPU kernels do not run here (see the log)")
    if args.attention != "auto":
        engine.executor.flex_attention = args.attention == "flex"
        engine.executor.native_attention = args.attention == "native"
    nbytes = engine.executor.model.streamed_bytes
    device = engine.executor.device
    bandwidth = read_bandwidth(device)
    reads = [bandwidth]
    dtype = str(engine.executor.dtype).removeprefix("torch.")
    if args.quantization:
        kernel = "kvloop's" if engine.executor.model.layers[0].qkv.native else "torch's"
        dtype += f", {args.quantization} weights through {kernel} kernel"
    path = ("flex, in place" if engine.executor.flex_attention else
            "decodes in place (kvloop's kernel)" if engine.executor.native_attention
            else "gather")
    print(f"# {device_name(device)}; {args.model} ({dtype}, attention: {path}): weights "
          f"read per step {nbytes / 1e6:.0f} MB, read bandwidth {bandwidth / 1e9:.1f} GB/s at the "
          f"start (floor {nbytes / bandwidth * 1000:.1f} ms per step); {args.prompt_len}-token "
          f"prompts, {OUTPUT_LEN} output tokens")
    decode_steps(engine, 1, seed=99, prompt_len=args.prompt_len)  # NOTE: warm-up
    print("| batch | floor ms | GEMMs ms | decode step ms (median) | step / floor | "
          "step / GEMMs | tok/s |")
    print("|---|---|---|---|---|---|---|")
    profiles = []
    for b in batches:
        times = decode_steps(engine, b, seed=b, prompt_len=args.prompt_len)
        step = statistics.median(times)
        gemms = gemm_time(engine, b)
        reads.append(read_bandwidth(device))
        floor = nbytes / max(reads[-2:])
        print(f"| {b} | {floor * 1000:.1f} | {gemms * 1000:.1f} | {step * 1000:.1f} | "
              f"{step / floor:.2f} | {step / gemms:.2f} | {b / step:.1f} |", flush=True)
        if args.profile:
            profiles.append(f"batch {b}: {profile_shares(engine, b, args.prompt_len)}")
    for line in profiles:
        print(line)
    low, high = min(reads), max(reads)
    print(f"read bandwidth over the run: {low / 1e9:.1f}-{high / 1e9:.1f} GB/s")
    if high > BANDWIDTH_SPREAD * low:
        print(f"NOTE: the read bandwidth moved by {high / low:.2f}x during this run; the floors "
              "and step/floor ratios move with it (compare ratios from alternating runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
