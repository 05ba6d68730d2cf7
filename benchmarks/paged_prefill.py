"""Prefill attention over paged KV: gathered and padded for SDPA, or read in place by
kvloop's kernel.

Part 1, attention alone. One pass = one step's prefill attention over every layer of a
model (its config's heads and head size, random K/V, each layer its own cache of
``--pool-blocks`` blocks, so nothing stays in cache between layers, as in a real step).
Each request's blocks are scattered over the pool. Both paths run in one process,
alternating, on the same caches and queries:

- ``gather + SDPA``: ``attention.paged_attention`` with the gather metadata (each group's
  blocks copied out with ``index_select``, queries padded to the group's longest chunk,
  ``scaled_dot_product_attention`` with ``is_causal`` or an additive mask);
- ``kvloop's kernel``: the same call with ``native=True`` (``native.prefill_attention``
  walks each chunk's block table in place, causal, no padding).

Printed per case: the median milliseconds of a pass for each path, their ratio, the
kernel's GFLOP/s (the causal pairs only: 4 · d flops per query head and key seen) and the
largest difference between the two outputs.

Part 2 (``--generate``), whole prefills: ``LLM.generate`` with one output token over the
same prompt sets, the runner's attention read in place or gathered (``native_attention``,
switched on the one engine between rounds), median seconds of ``--rounds`` rounds.

    python benchmarks/paged_prefill.py [--model default] [--dtype float32] [--generate]
        [--pool-blocks 4000] [--rounds 5]
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


def cases(rng: random.Random) -> list[tuple[str, list[int], list[int]]]:
    """(name, starts, lengths) of each measured step's prefill chunks."""
    varied = sorted(rng.randint(32, 512) for _ in range(16))
    prefixed = sorted(rng.randint(0, 1024) for _ in range(8))
    return [
        ("32 x 128, fresh", [0] * 32, [128] * 32),
        ("4 x 512, fresh", [0] * 4, [512] * 4),
        ("1 x 2048, fresh", [0], [2048]),
        ("16 fresh, 32-512", [0] * 16, varied),
        ("512 after 1536 cached", [1536], [512]),
        ("8 x 128 after 0-1024 cached", prefixed, [128] * 8),
    ]


def attention_alone(args: argparse.Namespace, cfg: ModelConfig, dtype: torch.dtype) -> None:
    heads, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, args.pool_blocks, BLOCK_SIZE, kv, d, generator=gen).to(dtype)
              for _ in range(cfg.num_layers)]
    print(f"## Attention alone: {cfg.num_layers} layers, {heads} heads / {kv} KV heads of {d}, "
          f"{args.dtype}, a {args.pool_blocks}-block pool per layer")
    print("| chunks | gather + SDPA, ms | kvloop's kernel, ms | ratio | kernel GFLOP/s "
          "| max abs diff |")
    print("|---|---|---|---|---|---|")
    for name, starts, lengths in cases(rng):
        ctx = [s + n for s, n in zip(starts, lengths, strict=True)]
        free = rng.sample(range(1, args.pool_blocks), sum(-(-c // BLOCK_SIZE) for c in ctx))
        tables, at = [], 0
        for c in ctx:
            need = -(-c // BLOCK_SIZE)
            tables.append(free[at:at + need])
            at += need
        q = torch.randn(sum(lengths), heads + 2 * kv, d, generator=gen).to(dtype)[:, :heads]
        metas = {}
        for path, in_place in (("gather", False), ("kernel", True)):
            metas[path], _ = build_metadata(
                starts=starts, lengths=lengths, block_tables=tables, num_decodes=0,
                block_size=BLOCK_SIZE, device=torch.device("cpu"), dtype=dtype,
                native=in_place)
        times: dict[str, list[float]] = {"gather": [], "kernel": []}
        with torch.inference_mode():
            diff = (paged_attention(q, caches[0], metas["gather"], d**-0.5).float()
                    - paged_attention(q, caches[0], metas["kernel"], d**-0.5).float())
            for _ in range(args.rounds):
                for path, meta in metas.items():
                    t = time.perf_counter()
                    for cache in caches:
                        paged_attention(q, cache, meta, d**-0.5)
                    times[path].append(time.perf_counter() - t)
        g, k = (statistics.median(times[p]) for p in ("gather", "kernel"))
        pairs = sum(n * s + n * (n + 1) / 2 for s, n in zip(starts, lengths, strict=True))
        gflops = pairs * heads * 4 * d * cfg.num_layers / k / 1e9
        print(f"| {name} | {g * 1e3:.1f} | {k * 1e3:.1f} | {g / k:.2f}x | {gflops:.1f} "
              f"| {diff.abs().max().item():.1e} |", flush=True)


def whole_prefills(args: argparse.Namespace) -> None:
    from kvloop import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_num_batched_tokens=args.budget,
              enable_prefix_caching=False)
    runner = llm.engine.executor
    if not getattr(runner, "native_attention", False):
        print("(the runner does not read attention in place here: part 2 skipped)")
        return
    vocab = runner.model_config.vocab_size
    rng = random.Random(1)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    print(f"\n## Whole prefills: LLM.generate, one output token, a {args.budget}-token budget, "
          f"{runner.precision}, seconds (median of {args.rounds})")
    print("| prompts | gather + SDPA | in place | ratio |")
    print("|---|---|---|---|")
    for name, count, length in (("32 x 128", 32, 128), ("4 x 1024", 4, 1024),
                                ("1 x 2048", 1, 2048)):
        prompts = [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]
        times: dict[bool, list[float]] = {False: [], True: []}
        llm.generate([{"prompt_token_ids": p} for p in prompts[:1]], params, use_tqdm=False)
        for _ in range(args.rounds):
            for in_place in (False, True):
                runner.native_attention = in_place
                t = time.perf_counter()
                llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                times[in_place].append(time.perf_counter() - t)
        runner.native_attention = True
        g, k = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {name} | {g:.2f} | {k:.2f} | {g / k:.2f}x |", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--pool-blocks", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--generate", action="store_true", help="also time whole prefills")
    p.add_argument("--budget", type=int, default=512, help="--generate's token budget")
    args = p.parse_args()
    if native.kernels() is None:
        why = native.unavailable_reason() or "their build failed"
        p.error(f"kvloop's kernels do not run here: {why}")
    cfg = ModelConfig.from_pretrained(resolve_model(args.model))
    print(f"# {device_name(torch.device('cpu'))}; {args.model}")
    attention_alone(args, cfg, getattr(torch, args.dtype))
    if args.generate:
        whole_prefills(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
