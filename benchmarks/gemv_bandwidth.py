"""How much of the machine's read bandwidth each CPU layout reaches for one decode row.

A one-stream decode step multiplies one activation row by every layer matrix, so each
product only streams its weights. This script builds the layer matrices of a model (its
config's shapes, random weights: the timing does not depend on the values), in each
layout kvloop can use on CPU, and times one pass over all of them at M = 1 with the
weights cold (every layer's own matrices, as in a real step, so nothing stays in cache),
against the read bandwidth of a plain sum over 1 GiB with the same threads. The weights
and the sum's buffer sit on transparent huge pages where the OS offers them, as
``load_model`` puts a model's weights (oneDNN's packed copies cannot move and stay on
torch's allocations):

- ``bf16 (kvloop's kernel)``: ``Bf16Linear`` (``native.bf16_linear``, ``vdpbf16ps``;
  kvloop's bfloat16 layout on CPUs with AVX-512 BF16);
- ``bf16 packed``: ``PackedLinear`` (oneDNN, weights reordered once; kvloop's bfloat16
  layout on other CPUs; only where oneDNN runs bfloat16: AVX-512 or AVX-NE-CONVERT);
- ``f32 (kvloop's kernel)``: ``F32Linear`` (``native.f32_linear``, FMA; kvloop's float32
  layout where its kernels run);
- ``f32 packed``: ``PackedLinear`` in float32 (oneDNN; kvloop's float32 layout elsewhere);
- ``int8 per-channel``: ``aten._weight_int8pack_mm`` (weight-only int8, one scale per row);
- ``int4 (kvloop's kernel)``: ``Int4Linear`` (``--quantization int4``) where kvloop's own
  kernel runs (``native.q4_linear``; half a byte per weight plus a float16 scale and offset
  per 32, as Q4_1 holds them: 0.625 bytes per weight);
- ``int4 (torch's kernel)``: the same through ``_weight_int4pack_mm_for_cpu`` (a bfloat16
  scale and zero per 32: 0.625 bytes per weight), as where kvloop's kernel cannot run.

Printed per thread count: milliseconds per pass, the GB/s of weight bytes that implies, and
that as a fraction of the sum's GB/s.

    python benchmarks/gemv_bandwidth.py [--model default] [--threads 1,2] [--repeats 15]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from decode_floor import read_bandwidth

from kvloop.engine.model_source import resolve_model
from kvloop.executor.torch import native
from kvloop.executor.torch.huge_pages import move_to_huge_pages
from kvloop.executor.torch.linear import (
    QUANT_GROUP,
    Bf16Linear,
    F32Linear,
    Int4Linear,
    PackedLinear,
    packable,
)
from kvloop.executor.torch.models import ModelConfig
from kvloop.executor.torch.profiler import device_name


def layer_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of one layer's fused QKV, O, fused gate/up and down matrices."""
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    return [(qkv, cfg.hidden_size), (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
            (2 * cfg.intermediate_size, cfg.hidden_size),
            (cfg.hidden_size, cfg.intermediate_size)]


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def pass_ms(calls: list[Callable[[], object]], repeats: int) -> float:
    """Median milliseconds of one pass over ``calls``."""

    def one() -> None:
        for c in calls:
            c()

    for _ in range(3):
        one()
    return statistics.median(_timed(one) for _ in range(repeats)) * 1e3


L = TypeVar("L", Bf16Linear, F32Linear, Int4Linear)


@contextlib.contextmanager
def _torch_kernels_only() -> Iterator[None]:
    """Layers built inside take torch's kernels, as where kvloop's own cannot run."""
    saved = native.kernels
    native.kernels = lambda: None  # type: ignore[assignment]
    try:
        yield
    finally:
        native.kernels = saved


def _on_huge_pages(mats: list[L]) -> list[L]:
    """``mats`` (linears), their tensors moved onto huge pages, as ``load_model`` moves a
    model's."""
    move_to_huge_pages([t for m in mats for t in m.tensors])
    return mats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    cfg = ModelConfig.from_pretrained(resolve_model(args.model))
    shapes = layer_shapes(cfg)
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes]
               for _ in range(cfg.num_layers)]
    rows = {k: torch.randn(1, k, dtype=torch.bfloat16) for _, k in shapes}
    layouts: dict[str, tuple[list[Callable[[], object]], float]] = {}
    """Name -> (one call per matrix, bytes read per weight)."""
    with torch.inference_mode():
        if native.bf16_supported():
            bf16 = _on_huge_pages([Bf16Linear(w.to(torch.bfloat16), None)
                                   for ws in weights for w in ws])
            layouts["bf16 (kvloop's kernel)"] = (
                [lambda m=m: m(rows[m.in_features]) for m in bf16], 2.0)
        if packable(weights[0][0].to(torch.bfloat16)):
            packed = [PackedLinear(w.to(torch.bfloat16), None) for ws in weights for w in ws]
            layouts["bf16 packed"] = ([lambda m=m: m(rows[m.in_features]) for m in packed],
                                      2.0)
        rows32 = {k: r.float() for k, r in rows.items()}
        if native.kernels() is not None:
            f32 = _on_huge_pages([F32Linear(w, None) for ws in weights for w in ws])
            layouts["f32 (kvloop's kernel)"] = (
                [lambda m=m: m(rows32[m.in_features]) for m in f32], 4.0)
        packed32 = [PackedLinear(w, None) for ws in weights for w in ws]
        layouts["f32 packed"] = ([lambda m=m: m(rows32[m.in_features]) for m in packed32], 4.0)
        int8_weights = []
        for ws in weights:
            for w in ws:
                scale = w.abs().amax(1) / 127
                int8_weights += [(w / scale[:, None]).round().to(torch.int8),
                                 scale.to(torch.bfloat16)]
        move_to_huge_pages(int8_weights)
        layouts["int8 per-channel"] = (
            [lambda q=q, s=s: torch.ops.aten._weight_int8pack_mm(rows[q.shape[1]], q, s)
             for q, s in zip(int8_weights[::2], int8_weights[1::2], strict=True)], 1.0)
        if native.kernels() is not None:
            int4 = _on_huge_pages([Int4Linear(w, None, torch.bfloat16)
                                   for ws in weights for w in ws])
            layouts["int4 (kvloop's kernel)"] = (
                [lambda m=m: m(rows[m.in_features]) for m in int4], 0.5 + 4 / QUANT_GROUP)
        with _torch_kernels_only():
            int4 = _on_huge_pages([Int4Linear(w, None, torch.bfloat16)
                                   for ws in weights for w in ws])
        layouts["int4 (torch's kernel)"] = ([lambda m=m: m(rows[m.in_features]) for m in int4],
                                            0.5 + 4 / QUANT_GROUP)
    elements = sum(n * k for n, k in shapes) * cfg.num_layers
    cpu = device_name(torch.device("cpu")).rsplit(", ", 1)[0]  # threads: per row below
    print(f"# {cpu}; {args.model}: {cfg.num_layers} layers, "
          f"{elements / 1e6:.0f} M layer weights, M = 1, weights cold")
    print("| threads | sum GB/s | layout | ms per pass | weight GB/s | of the sum |")
    print("|---|---|---|---|---|---|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        bandwidth = read_bandwidth(torch.device("cpu")) / 1e9
        with torch.inference_mode():
            for name, (calls, nbytes) in layouts.items():
                ms = pass_ms(calls, args.repeats)
                gbps = elements * nbytes / ms / 1e6
                print(f"| {threads} | {bandwidth:.1f} | {name} | {ms:.2f} | {gbps:.1f} | "
                      f"{gbps / bandwidth:.0%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
