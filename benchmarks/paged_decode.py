"""Decode attention over paged KV: gathered into a copy, or read in place by kvloop's kernel.

One pass = one decode step's attention over every layer of a model (its config's heads and
head size, random K/V, each layer its own cache of ``--pool-blocks`` blocks, so nothing
stays in cache between layers, as in a real step). Each request's blocks are scattered over
the pool. Both paths run in one process, alternating, on the same caches and queries:

- ``gather + SDPA``: ``attention.paged_attention`` with the gather metadata (each group's
  blocks copied out with ``index_select``, then ``scaled_dot_product_attention``);
- ``kvloop's kernel``: the same call with ``native=True`` (``native.decode_attention``
  walks each request's block table in place).

Printed per batch: the median milliseconds of a pass for each path, their ratio, and the
largest difference between their outputs.

    python benchmarks/paged_decode.py [--model default] [--batches 1,8,32]
        [--context 150-250] [--dtype bfloat16] [--pool-blocks 4000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kvloop.engine.model_source import resolve_model
from kvloop.executor.torch import native
from kvloop.executor.torch.attention import build_metadata, paged_attention
from kvloop.executor.torch.models import ModelConfig
from kvloop.executor.torch.profiler import device_name

BLOCK_SIZE = 16


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--model", default="default")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", default="150-250", help="range of context lengths (tokens)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--pool-blocks", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    if native.kernels() is None:
        why = native.unavailable_reason() or "their build failed"
        p.error(f"kvloop's kernels do not run here: {why}")
    lo, hi = (int(v) for v in args.context.split("-"))
    cfg = ModelConfig.from_pretrained(resolve_model(args.model))
    dtype = getattr(torch, args.dtype)
    heads, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, args.pool_blocks, BLOCK_SIZE, kv, d, generator=gen).to(dtype)
              for _ in range(cfg.num_layers)]
    print(f"# {device_name(torch.device('cpu'))}; {args.model}: {cfg.num_layers} layers, "
          f"{heads} heads / {kv} KV heads of {d}, {args.dtype}, contexts {lo}-{hi} tokens, "
          f"a {args.pool_blocks}-block pool per layer")
    print("| batch | gather + SDPA, ms | kvloop's kernel, ms | ratio | max abs diff |")
    print("|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        lens = sorted(rng.randint(lo, hi) for _ in range(batch))
        free = rng.sample(range(1, args.pool_blocks), sum(-(-n // BLOCK_SIZE) for n in lens))
        tables, at = [], 0
        for n in lens:
            need = -(-n // BLOCK_SIZE)
            tables.append(free[at:at + need])
            at += need
        q = torch.randn(batch, heads + 2 * kv, d, generator=gen).to(dtype)[:, :heads]
        metas = {}
        for name, in_place in (("gather", False), ("kernel", True)):
            metas[name], _ = build_metadata(
                starts=[n - 1 for n in lens], lengths=[1] * batch, block_tables=tables,
                num_decodes=batch, block_size=BLOCK_SIZE, device=torch.device("cpu"),
                dtype=dtype, native=in_place)
        times: dict[str, list[float]] = {"gather": [], "kernel": []}
        with torch.inference_mode():
            diff = (paged_attention(q, caches[0], metas["gather"], d**-0.5).float()
                    - paged_attention(q, caches[0], metas["kernel"], d**-0.5).float())
            for _ in range(args.rounds):
                for name, meta in metas.items():
                    t = time.perf_counter()
                    for cache in caches:
                        paged_attention(q, cache, meta, d**-0.5)
                    times[name].append(time.perf_counter() - t)
        g, k = (statistics.median(times[n]) * 1e3 for n in ("gather", "kernel"))
        print(f"| {batch} | {g:.2f} | {k:.2f} | {g / k:.1f}x | {diff.abs().max().item():.1e} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
