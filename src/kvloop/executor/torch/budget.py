"""The default token budget of a step: what keeps steps short enough on this device.

On CUDA a 2048-token step takes milliseconds, so the budget is vLLM's default. On a CPU the
same step of a small model takes seconds and freezes every stream for that long, so the
budget follows from a target step time and the model's measured cost per prompt token: one
real 64-token prefill step through the runner at start-up (after a 16-token warm-up, about
a quarter of a second for the default model), rounded down to a multiple of 64 in
[64, 2048].
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
    prefill_time(runner, 16)  # warm-up
    per_token = prefill_time(runner, _PROBE_TOKENS) / _PROBE_TOKENS
    tokens = int(CPU_TARGET_STEP_S / per_token) // 64 * 64
    budget = min(MAX_BUDGET, max(MIN_BUDGET, tokens))
    return budget, (f"for ~{CPU_TARGET_STEP_S:g} s steps at ~{per_token * 1e3:.1f} ms per "
                    "prompt token, measured")
