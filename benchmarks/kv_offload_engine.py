"""The prefix cache's host tier on the real engine (CPU, the default model): direction check.

Conversations resend their history each turn (a shared system prompt, then every earlier
turn and answer); each round sends one turn of every conversation, so a small device pool
has dropped a conversation's history by its next turn. Runs the rounds with no host tier
and with ``--offload-gib`` of host tier, greedy, and prints prompt tokens computed, prefix
hit rate, blocks loaded, TTFT mean of the later turns and wall time (medians over
``--repeats`` alternated runs), and whether the outputs are identical (float32 by default:
in bfloat16 a prefill cut at another place may round differently, with or without a tier).

    python benchmarks/kv_offload_engine.py [--conversations 6] [--turns 3]
        [--num-gpu-blocks 96] [--offload-gib 0.25] [--device cpu] [--dtype float32]
        [--repeats 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from kvloop.engine.args import EngineArgs
from kvloop.engine.llm_engine import LLMEngine
from kvloop.sampling_params import SamplingParams


def run(args: argparse.Namespace, offload_gib: float) -> dict[str, Any]:
    engine = LLMEngine.from_args(EngineArgs(
        device=args.device, dtype=args.dtype, num_gpu_blocks=args.num_gpu_blocks,
        max_num_batched_tokens=512,
        max_model_len=4096, kv_offload_space=offload_gib, swap_space=0.0))
    rng = random.Random(0)
    vocab = 40_000
    system = [rng.randrange(100, vocab) for _ in range(args.system_tokens)]
    history = [list(system) for _ in range(args.conversations)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    outputs: list[list[int]] = []
    ttfts: list[float] = []
    start = time.perf_counter()
    for turn in range(args.turns):
        ids = []
        for c, h in enumerate(history):
            h.extend(rng.randrange(100, vocab) for _ in range(args.user_tokens))
            ids.append(engine.add_request(f"c{c}t{turn}", list(h), params))
        done: dict[str, Any] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        for c, rid in enumerate(ids):
            out = done[rid]
            assert out.error is None, out.error
            history[c].extend(out.token_ids)
            outputs.append(list(out.token_ids))
            if turn:
                ttfts.append(out.metrics.ttft)
    wall = time.perf_counter() - start
    s = engine.scheduler
    host = s.kv.host.stats
    return {"prompt_computed": s.stats.num_prompt_tokens,
            "hit_rate": s.stats.prefix_cache_hits / max(1, s.stats.prefix_cache_queries),
            "loaded": host.blocks_loaded, "stored": host.blocks_stored,
            "ttft": sum(ttfts) / len(ttfts), "wall": wall, "outputs": outputs}


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The first run, with TTFT and wall time the median over the repeats."""
    out = dict(rows[0])
    for key in ("ttft", "wall"):
        out[key] = statistics.median(r[key] for r in rows)
    out["same"] = all(r["outputs"] == rows[0]["outputs"] for r in rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--user-tokens", type=int, default=96)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--num-gpu-blocks", type=int, default=96)
    ap.add_argument("--offload-gib", type=float, default=0.25)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    runs: dict[float, list[dict[str, Any]]] = {0.0: [], args.offload_gib: []}
    for _ in range(args.repeats):  # NOTE: alternated, so a busy spell hits both alike
        for gib in runs:
            runs[gib].append(run(args, gib))
    plain, tiered = (_median(runs[0.0]), _median(runs[args.offload_gib]))
    print(f"{'':<22}{'prompt tok computed':>20}{'hit rate':>10}{'loaded':>8}{'stored':>8}"
          f"{'TTFT later turns':>18}{'wall':>8}")
    for name, r in (("no host tier", plain), (f"host tier {args.offload_gib:g} GiB", tiered)):
        print(f"{name:<22}{r['prompt_computed']:>20}{100 * r['hit_rate']:>9.1f}%"
              f"{r['loaded']:>8}{r['stored']:>8}{r['ttft']:>17.3f}s{r['wall']:>7.1f}s")
    print("greedy outputs identical:", plain["outputs"] == tiered["outputs"],
          f"(repeats agree: {plain['same'] and tiered['same']})")


if __name__ == "__main__":
    main()
