"""``LLMEngine.step`` over a null executor: the engine's own cost per running request.

N requests with distinct prompts of P tokens (``ignore_eos``, a ``max_tokens`` none reaches)
are prefilled (a large token budget, untimed), then K decode steps are timed with
``time.perf_counter`` around ``engine.step()`` alone: the scheduler, ``update_from_output``
and building each request's ``RequestOutput``. The executor samples token 3 for every
scheduled request, instantly. Prefix caching is on (block 16). ``--detokenize`` gives the
engine the default model's tokenizer (incremental detokenization of every token);
without it outputs are token ids only. Each cell is the median of ``--repeats`` runs on a
fresh engine, in µs per running request per step.

The target: at most 3 µs per running request per step, flat in prompt length.

    python benchmarks/engine_step.py [--sizes 64 256 1024] [--prompts 16 2048 8192]
        [--steps 50] [--repeats 3] [--detokenize] [--json PATH]

To compare two trees in one run, point ``PYTHONPATH`` at each tree's ``src`` in turn
(``docs/benchmarks.md`` shows the before/after table).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any

import kvloop
from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core.interface import ModelRunnerOutput, SchedulerOutput
from kvloop.core.scheduler import Scheduler
from kvloop.engine.llm_engine import LLMEngine
from kvloop.sampling_params import SamplingParams

BLOCK = 16


class NullExecutor:
    """Samples token 3 for every scheduled request, instantly."""

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput(dict.fromkeys(out.num_scheduled_tokens, (3,)), 0.0)


def run_once(n: int, prompt_len: int, steps: int, tokenizer: Any | None) -> float:
    """µs per running request per decode step, over ``steps`` timed steps."""
    budget = max(65536, prompt_len)
    # Requests prefilled first decode while the others prefill: none may finish.
    max_tokens = steps + 32 + -(-n * prompt_len // budget)
    max_len = prompt_len + max_tokens + 1
    blocks = n * (-(-max_len // BLOCK) + 1)
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=n, max_model_len=max_len),
        CacheConfig(block_size=BLOCK, num_gpu_blocks=blocks, enable_prefix_caching=True),
    )
    engine = LLMEngine(sched, NullExecutor(), tokenizer=tokenizer, vocab_size=None)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(n):
        # Distinct from the first block on, so nothing is shared through the prefix cache.
        prompt = [10 + i % 1000, 10 + i // 1000] + [(i * 7 + j) % 30000 + 5
                                                     for j in range(prompt_len - 2)]
        engine.add_request(f"r{i}", prompt, params)
    while len(sched.running) < n or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()
    gc.collect()
    gc.disable()
    try:
        total = 0.0
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            total += time.perf_counter() - start
    finally:
        gc.enable()
    assert len(sched.running) == n, "a request finished or was preempted while timed"
    return total / steps / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--prompts", type=int, nargs="+", default=[16, 2048, 8192])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--detokenize", action="store_true",
                    help="detokenize with the default model's tokenizer")
    ap.add_argument("--label", default=None, help="a name for this tree in the output")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()
    tokenizer = None
    if args.detokenize:
        from kvloop.engine.model_source import resolve_model
        from kvloop.engine.tokenizer import Tokenizer

        tokenizer = Tokenizer(resolve_model("default"))
    label = args.label or kvloop.__file__
    rows = []
    print(f"# LLMEngine.step, null executor, µs per running request per step ({label})")
    print(f"{'N':>6} " + " ".join(f"{f'P={p}':>10}" for p in args.prompts))
    for n in args.sizes:
        cells = []
        for p in args.prompts:
            us = statistics.median(run_once(n, p, args.steps, tokenizer)
                                   for _ in range(args.repeats))
            cells.append(us)
            rows.append({"n": n, "prompt_len": p, "us_per_req_step": us,
                         "detokenize": args.detokenize, "label": label})
        print(f"{n:>6} " + " ".join(f"{c:>10.2f}" for c in cells), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
