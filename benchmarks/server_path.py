"""The server's per-token path without HTTP: engine thread -> asyncio -> SSE chunks.

N streaming completions (prompts of P token ids, ``ignore_eos``, T output tokens) go through
``OpenAIServing`` and ``AsyncEngine`` exactly as ``kvloop serve`` runs them (validation on
the event loop, the engine on its thread, outputs handed over once per step, one SSE chunk
per token), over a null executor that samples token 3 instantly. Each cell runs twice, with
T and 3T output tokens, timed from queueing to the last ``[DONE]``; the difference over
N·2T tokens is the cost of a decoded token (admission and prefill cancel out).

Reported: µs per token (= per running request per step) on this path, next to
``LLMEngine.step`` alone on the same workload (``benchmarks/engine_step.py``'s method), and
their difference: what the event loop, the hand-over and the SSE formatting add. Both
threads share the GIL, so the sum is what a CPU-bound server pays.

    python benchmarks/server_path.py [--sizes 64 256] [--prompts 16 2048] [--tokens 64]
        [--detokenize]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from typing import Any

from engine_step import NullExecutor, run_once

from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core.scheduler import Scheduler
from kvloop.engine.llm_engine import LLMEngine
from kvloop.server.async_engine import AsyncEngine
from kvloop.server.protocol import CompletionRequest
from kvloop.server.serving import OpenAIServing

BLOCK = 16


def _engine(n: int, prompt_len: int, tokens: int, tokenizer: Any | None) -> LLMEngine:
    max_len = prompt_len + tokens + 1
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=max(65536, prompt_len), max_num_seqs=n,
                        max_model_len=max_len),
        CacheConfig(block_size=BLOCK, num_gpu_blocks=n * (-(-max_len // BLOCK) + 1)),
    )
    return LLMEngine(sched, NullExecutor(), tokenizer=tokenizer,
                     vocab_size=50_000 if tokenizer is None else None)


async def _serve_once(n: int, prompt_len: int, tokens: int, tokenizer: Any | None) -> float:
    """Seconds from queueing N streams to the last ``[DONE]``."""
    engine = AsyncEngine(_engine(n, prompt_len, tokens, tokenizer))
    engine.start()
    serving = OpenAIServing(engine, "bench")
    try:
        jobs = []
        for i in range(n):
            prompt = [10 + i % 1000, 10 + i // 1000] + [(i * 7 + j) % 30000 + 5
                                                         for j in range(prompt_len - 2)]
            body = CompletionRequest(model="bench", prompt=prompt, max_tokens=tokens,
                                     stream=True, ignore_eos=True, temperature=0.0)
            jobs.append(serving.prepare_completion(body, time.monotonic()))
        gc.collect()

        async def consume(job: Any) -> int:
            chunks = 0
            async for _ in serving.stream(job, serving.submit(job)):
                chunks += 1
            return chunks

        start = time.perf_counter()
        counts = await asyncio.gather(*(consume(j) for j in jobs))
        elapsed = time.perf_counter() - start
    finally:
        engine.shutdown()
    assert all(c >= tokens for c in counts), "a stream ended early"
    return elapsed


def serve_per_token(n: int, prompt_len: int, tokens: int, tokenizer: Any | None) -> float:
    """µs per decoded token on the server path: two runs, T and 3T output tokens, so that
    admission and prefill (the same in both) cancel out of the difference."""
    short = asyncio.run(_serve_once(n, prompt_len, tokens, tokenizer))
    long = asyncio.run(_serve_once(n, prompt_len, 3 * tokens, tokenizer))
    return (long - short) / (n * 2 * tokens) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prompts", type=int, nargs="+", default=[16, 2048])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--detokenize", action="store_true",
                    help="detokenize with the default model's tokenizer")
    args = ap.parse_args()
    tokenizer = None
    if args.detokenize:
        from kvloop.engine.model_source import resolve_model
        from kvloop.engine.tokenizer import Tokenizer

        tokenizer = Tokenizer(resolve_model("default"))
    print("# µs per token (per running request per step), null executor"
          + (", detokenized" if tokenizer else ", token ids"))
    print(f"{'N':>6} {'P':>6} {'engine.step':>12} {'server path':>12} {'added':>8}")
    for n in args.sizes:
        for p in args.prompts:
            eng = statistics.median(run_once(n, p, args.tokens, tokenizer)
                                    for _ in range(args.repeats))
            srv = statistics.median(serve_per_token(n, p, args.tokens, tokenizer)
                                    for _ in range(args.repeats))
            print(f"{n:>6} {p:>6} {eng:>12.2f} {srv:>12.2f} {srv - eng:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
