"""The default token budget of a step: what keeps steps short enough on this device.

On CUDA a 2048-token step takes milliseconds, so the budget is vLLM's default. On a CPU the
same step of a small model takes seconds and freezes every stream for that long, so the
budget follows from a target step time and the model's measured cost per prompt token: real
64-token prefill steps through the runner at start-up, rounded down to a multiple of 64 in
[64, 2048]. The first step of a fresh process is many times slower than the next ones
(weights paged in, kernels and allocator caches set up: 36 ms/token cold against 1.4 warm for
the default model on 2 cores), so one untimed step of the same size comes first and the
fastest of ``_PROBE_REPEATS`` timed ones counts: a cold start picks the budget a warm one
does. About half a second for the default model.
"""

from __future__ import annotations

import time
from typing import Any

from kvloop.core.interface import CachedRequestData, NewRequestData, SchedulerOutput
from kvloop.sampling_params import SamplingParams

CUDA_BUDGET = 2048
"""Tokens per step on CUDA (vLLM's default)."""
CPU_TARGET_STEP_S = 0.5
"""The step time the CPU budget aims at: what a prompt chunk adds to every stream's ITL."""
MIN_BUDGET, MAX_BUDGET = 64, 2048
_PROBE_TOKENS = 64
_PROBE_REPEATS = 3


def prefill_time(runner: Any, tokens: int) -> float:
    """Seconds of one runner step that prefills ``tokens`` tokens of one request (its KV
    goes to free blocks that nothing reads; the request is forgotten afterwards)."""
    rid = "kvloop-budget-probe"
    blocks = list(range(-(-tokens // runner.block_size)))
    new = NewRequestData(rid, list(range(3, 3 + tokens)), [],
                         SamplingParams(temperature=0.0, max_tokens=1), blocks, 0)
    out = SchedulerOutput(0, [new], CachedRequestData(), {rid: tokens}, tokens)
    start = time.perf_counter()
    try:
        runner.execute(out)
    finally:
        runner.requests.pop(rid, None)
    return time.perf_counter() - start


def default_token_budget(runner: Any) -> tuple[int, str]:
    """(budget, why) for a runner that was not given one."""
    if runner.device.type == "cuda":
        return CUDA_BUDGET, "the CUDA default"
    prefill_time(runner, _PROBE_TOKENS)  # warm-up, untimed: the same shapes as the probes
    # NOTE: the fastest, not the mean: a slow repeat is the machine (a neighbour, a page-in),
    # not the model's cost.
    per_token = min(prefill_time(runner, _PROBE_TOKENS)
                    for _ in range(_PROBE_REPEATS)) / _PROBE_TOKENS
    tokens = int(CPU_TARGET_STEP_S / per_token) // 64 * 64
    budget = min(MAX_BUDGET, max(MIN_BUDGET, tokens))
    return budget, (f"for ~{CPU_TARGET_STEP_S:g} s steps at ~{per_token * 1e3:.1f} ms per "
                    "prompt token, measured")
