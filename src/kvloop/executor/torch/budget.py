"""The default token budget of a step: what keeps steps short enough on this device.

On CUDA a 2048-token step takes milliseconds, so the budget is vLLM's default. On a CPU the
same step of a small model takes seconds and freezes every stream for that long, so the
budget follows from a target step time and the model's measured cost per prompt token: real
64-token prefill steps through the runner at start-up, rounded down to a multiple of 64 in
[64, 2048]. The first step of a fresh process is many times slower than the next ones
(weights paged in, kernels and allocator caches set up: 36 ms/token cold against 1.4 warm for
the default model on 2 cores), so one untimed step of the same size comes first, and
timed ones follow until the fastest has stopped improving (``_settled``): at least
``_MIN_PROBES``, at most ``_MAX_PROBES`` or ``_PROBE_SECONDS``. Right after an install or
a conversion the machine can stay slow for several steps (a fresh-clone review measured
10-64 ms per token on the first probes); probing until the steps settle keeps such a start
from choosing the minimum budget. About half a second for the default model on a warm
machine. A machine that stays busy throughout still measures slow and gets a small budget:
``--max-num-batched-tokens`` sets it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvloop.core.interface import CachedRequestData, NewRequestData, SchedulerOutput
from kvloop.sampling_params import SamplingParams

CUDA_BUDGET = 2048
"""Tokens per step on CUDA (vLLM's default)."""
CPU_TARGET_STEP_S = 0.5
"""The step time the CPU budget aims at: what a prompt chunk adds to every stream's ITL."""
MIN_BUDGET, MAX_BUDGET = 64, 2048
_PROBE_TOKENS = 64
_MIN_PROBES, _MAX_PROBES = 3, 12
_PROBE_SECONDS = 5.0
"""Probing stops after this long (timed probes only), settled or not."""
_SETTLED = 0.9
"""The fastest probe has settled once the last two probes did not beat it by 10%."""


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
    per_token = _settled(lambda: prefill_time(runner, _PROBE_TOKENS)) / _PROBE_TOKENS
    tokens = int(CPU_TARGET_STEP_S / per_token) // 64 * 64
    budget = min(MAX_BUDGET, max(MIN_BUDGET, tokens))
    return budget, (f"for ~{CPU_TARGET_STEP_S:g} s steps at ~{per_token * 1e3:.1f} ms per "
                    "prompt token, measured")


def _settled(probe: Callable[[], float]) -> float:
    """The fastest of repeated ``probe()`` times once it stops improving (module
    docstring)."""
    best = probe()
    probes, since_better = 1, 0
    deadline = time.monotonic() + _PROBE_SECONDS
    while probes < _MAX_PROBES and time.monotonic() < deadline:
        if probes >= _MIN_PROBES and since_better >= 2:
            break
        t = probe()
        probes += 1
        since_better = 0 if t < best * _SETTLED else since_better + 1
        best = min(best, t)
    return best
