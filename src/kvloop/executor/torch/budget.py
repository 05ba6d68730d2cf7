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
a conversion the machine can stay slow for several steps (10-64 ms per token on the first
probes of a fresh clone); probing until the steps settle keeps such a start from choosing
the minimum budget. About half a second for the default model on a warm
machine.

The budget is a property of the machine and the model, not of the minute: the measured cost
per token is recorded (``cache_dir()/token_budgets``, keyed by the model's files, the CPU,
the thread count, the dtype, the quantization and kvloop's executor:
``identity.machine_model_key``) and every later start reads it instead of timing again.
``kvloop profile --token-budget`` measures again (on an idle machine: a busy one measures
slow); the start-up line says where the figure came from, and when the floor or the
ceiling applied. ``--max-num-batched-tokens`` sets the budget outright.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvloop.core.interface import CachedRequestData, NewRequestData, SchedulerOutput
from kvloop.paths import cache_dir
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


def records_dir() -> Path:
    """Where measured costs per token are recorded (module docstring)."""
    return cache_dir() / "token_budgets"


def record_path(runner: Any) -> Path:
    """The record of ``runner``'s model, dtype and quantization on this machine."""
    from kvloop.executor.torch.identity import machine_model_key

    key = machine_model_key(runner.model_path, dtype=runner.dtype,
                            quantization=runner.quantization, probe_tokens=_PROBE_TOKENS)
    return records_dir() / f"{key}.json"


def measure_per_token(runner: Any) -> float:
    """Seconds per prompt token of a settled 64-token prefill step (module docstring)."""
    if (model := getattr(runner, "model", None)) is not None:
        model.adopt_moved_weights(wait=True)  # NOTE: the weights as they serve
    prefill_time(runner, _PROBE_TOKENS)  # warm-up, untimed: the same shapes as the probes
    # NOTE: the fastest, not the mean: a slow repeat is the machine (a neighbour, a page-in),
    # not the model's cost.
    return _settled(lambda: prefill_time(runner, _PROBE_TOKENS)) / _PROBE_TOKENS


def budget_for(per_token: float) -> tuple[int, str]:
    """(budget, the words for it) for steps of ``CPU_TARGET_STEP_S`` at ``per_token`` seconds
    per prompt token, rounded down to a multiple of 64 and kept in [64, 2048]."""
    tokens = int(CPU_TARGET_STEP_S / per_token) // 64 * 64
    budget = min(MAX_BUDGET, max(MIN_BUDGET, tokens))
    rate = f"~{CPU_TARGET_STEP_S:g} s steps at ~{per_token * 1e3:.3g} ms per prompt token"
    if tokens < MIN_BUDGET:
        return budget, f"the floor: {rate} would allow {int(CPU_TARGET_STEP_S / per_token)}"
    if tokens > MAX_BUDGET:
        return budget, f"the ceiling: {rate} would allow {tokens}"
    return budget, f"for {rate}"


def default_token_budget(runner: Any, *, measure: bool = False) -> tuple[int, str]:
    """(budget, why) for a runner that was not given one: CUDA's, or on CPU from the cost
    per token recorded for this machine and model, measured (and recorded) when there is
    no record yet or ``measure`` is set (module docstring)."""
    if runner.device.type == "cuda":
        return CUDA_BUDGET, "the CUDA default"
    path = record_path(runner)
    record = None if measure else _read(path)
    if record is not None:
        budget, words = budget_for(record["per_token_s"])
        busy = record.get("load_per_cpu", 0.0) > BUSY_LOAD
        return budget, (f"{words}, measured {record['measured']} on this machine"
                        + (" while it was busy" if busy else "")
                        + "; kvloop profile --token-budget measures again")
    load = _load_per_cpu()
    per_token = measure_per_token(runner)
    _write(path, {"per_token_s": per_token,
                  "measured": datetime.date.today().isoformat(),
                  "load_per_cpu": load})
    budget, words = budget_for(per_token)
    busy = (f"; the machine was busy ({load:.1f} runnable per CPU): kvloop profile "
            "--token-budget on an idle one measures again" if load > BUSY_LOAD else "")
    return budget, f"{words}, measured now and kept for later starts{busy}"


BUSY_LOAD = 0.5
"""Runnable tasks per CPU (the one-minute load average) above which a measurement is
called busy in the start-up line."""


def _load_per_cpu() -> float:
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 0.0


def _read(path: Path) -> dict[str, Any] | None:
    """The record at ``path``, or None when missing or unreadable (then measured again)."""
    try:
        record = json.loads(path.read_text())
        per_token = float(record["per_token_s"])
        str(record["measured"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if per_token > 0 else None


def _write(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` atomically (a reader never sees half a file); a cache that cannot be
    written only means measuring again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False,
                                         suffix=".tmp") as f:
            json.dump(record, f)
        os.replace(f.name, path)
    except OSError:
        pass


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
