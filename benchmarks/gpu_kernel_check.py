"""Check the simulator's kernel curves on the GPU at hand (one with no public profile).

On this device, in bf16 with public kernels (cuBLAS through ``torch.mm``, PyTorch's
``scaled_dot_product_attention``):

- Llama-3.1-8B's four projection GEMMs at 1 ... 8192 tokens (weights cycled through
  enough copies to defeat the L2 cache, as in a real forward pass), against the cost
  model's GEMM curve for the ``--gpu`` preset (for an unprofiled GPU: the curve derived from
  its specs, never fitted to it);
- causal prefill attention (32 heads, 8 KV heads, head dim 128, 16k tokens per call) by
  sequence length, as a fraction of peak FLOP/s, against the attention curve;
- decode attention (one query per request over a contiguous KV cache) by batch and
  context, as a fraction of memory bandwidth, against the attention curve.

Prints measured vs predicted with % errors and writes ``--json``. About a minute on a
GPU; ``--quick`` shrinks everything for a CPU smoke run.

    python benchmarks/gpu_kernel_check.py --gpu h200 [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvloop.executor.simulated import get_hardware_spec

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}


def timed(fn, device: torch.device, runs: int = 10) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_rows(hw, device, dtype, tokens: list[int], scale: int) -> list[dict]:
    g = hw.efficiency().gemm
    rows = []
    for name, (n, k) in SHAPES.items():
        n, k = n // scale, k // scale
        copies = max(2, int(256e6 // (n * k * 2)) + 1)  # > 2x a 128 MB L2
        weights = [torch.randn(k, n, device=device, dtype=dtype) for _ in range(copies)]
        for t in tokens:
            x = torch.randn(t, k, device=device, dtype=dtype)

            def run(x=x, weights=weights) -> None:
                for w in weights:
                    torch.mm(x, w)

            measured = timed(run, device) / copies
            f, b = 2.0 * t * n * k, 2.0 * (n * k + t * k + t * n)
            predicted = g.time(f, b, hw.peak_flops, hw.mem_bandwidth)
            rows.append({"gemm": name, "tokens": t, "measured_s": measured,
                         "predicted_s": predicted, "error": predicted / measured - 1,
                         "fraction_of_peak": f / measured / hw.peak_flops,
                         "fraction_of_bandwidth": b / measured / hw.mem_bandwidth})
        del weights
    return rows


def attention_rows(hw, device, dtype, quick: bool) -> tuple[list[dict], list[dict]]:
    a = hw.efficiency().attention
    heads, kv_heads, d = (8, 2, 64) if quick else (32, 8, 128)
    prefill = []
    total = 2048 if quick else 16384
    for s in ([128, 512] if quick else [512, 1024, 2048, 4096, 8192]):
        b = total // s
        q = torch.randn(b, heads, s, d, device=device, dtype=dtype)
        # NOTE: distinct K and V tensors: one tensor passed twice is read once, which
        # halves the bytes moved and made decode look faster than the memory allows.
        k = torch.randn(b, kv_heads, s, d, device=device, dtype=dtype)
        v = torch.randn(b, kv_heads, s, d, device=device, dtype=dtype)
        t = timed(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True), device)
        flops = 4.0 * b * heads * d * s * (s + 1) / 2
        measured = flops / t / hw.peak_flops
        predicted = a.prefill_fraction * s / (s + a.prefill_half_context)
        prefill.append({"seqlen": s, "batch": b, "measured_fraction": measured,
                        "predicted_fraction": predicted, "error": measured / predicted - 1})
    decode = []
    for batch in ([4, 16] if quick else [16, 64, 128]):
        for ctx in ([128, 512] if quick else [256, 1024, 4096]):
            q = torch.randn(batch, heads, 1, d, device=device, dtype=dtype)
            k = torch.randn(batch, kv_heads, ctx, d, device=device, dtype=dtype)
            v = torch.randn(batch, kv_heads, ctx, d, device=device, dtype=dtype)
            t = timed(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                q, k, v, enable_gqa=True), device)
            nbytes = 2.0 * batch * kv_heads * ctx * d * k.element_size()  # K and V, read once
            measured = nbytes / t / hw.mem_bandwidth
            predicted = a.decode_fraction * ctx / (ctx + a.decode_half_context)
            decode.append({"batch": batch, "context": ctx, "measured_fraction": measured,
                           "predicted_fraction": predicted, "error": measured / predicted - 1})
    return prefill, decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", default="h200", help="hardware preset or JSON spec to check")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hw = get_hardware_spec(args.gpu)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    dtype = torch.bfloat16
    tokens = [1, 16, 128] if args.quick else [1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                               8192]
    with torch.inference_mode():
        gemms = gemm_rows(hw, device, dtype, tokens, 16 if args.quick else 1)
        prefill, decode = attention_rows(hw, device, dtype, args.quick)
    print(f"{name} vs the '{hw.name}' preset ({hw.efficiency().source.split(' (')[0]}), "
          f"torch {torch.__version__}")
    print(f"\n{'GEMM':<9}{'tokens':>7}{'measured µs':>13}{'model µs':>10}{'error':>8}"
          f"{'of peak':>9}{'of BW':>7}")
    for r in gemms:
        print(f"{r['gemm']:<9}{r['tokens']:>7}{r['measured_s'] * 1e6:13.1f}"
              f"{r['predicted_s'] * 1e6:10.1f}{r['error']:+8.1%}{r['fraction_of_peak']:9.2f}"
              f"{r['fraction_of_bandwidth']:7.2f}")
    errs = [abs(r["error"]) for r in gemms]
    print(f"GEMM |error|: median {statistics.median(errs):.1%}, max {max(errs):.1%}")
    print(f"\n{'prefill attention':<20}{'measured':>9}{'model':>7}  (fraction of peak FLOP/s)")
    for r in prefill:
        print(f"{'seqlen ' + str(r['seqlen']):<20}{r['measured_fraction']:9.3f}"
              f"{r['predicted_fraction']:7.3f}")
    print(f"\n{'decode attention':<20}{'measured':>9}{'model':>7}  (fraction of bandwidth)")
    for r in decode:
        label = f"{r['batch']} x {r['context']}"
        print(f"{label:<20}{r['measured_fraction']:9.3f}"
              f"{r['predicted_fraction']:7.3f}")
    if args.json:
        args.json.write_text(json.dumps({"device": name, "preset": hw.name,
                                         "torch": torch.__version__, "gemm": gemms,
                                         "prefill_attention": prefill,
                                         "decode_attention": decode}, indent=1))


if __name__ == "__main__":
    main()
