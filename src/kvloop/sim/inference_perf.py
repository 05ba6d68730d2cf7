"""Workloads from inference-perf configs: simulate the benchmark you already run.

`inference-perf <https://github.com/kubernetes-sigs/inference-perf>`_ (Kubernetes SIGs' load
generator, used by llm-d) describes a benchmark as ``data`` (what each request asks) and
``load`` (when requests are sent, in ``stages`` of a rate and a duration). This module reads
such a config (YAML or JSON) and builds the same requests:

* ``data.type: shared_prefix``: ``num_groups`` system prompts of ``system_prompt_len``
  tokens, each shared by ``num_prompts_per_group`` questions of ``question_len`` tokens
  (inference-perf's older spelling, ``num_unique_system_prompts`` and
  ``num_users_per_system_prompt``, is read too); request ``i`` sends prompt ``i mod n`` of
  the ``n`` prompts in one seeded shuffle, as inference-perf cycles through them. Each system
  prompt is a run of token ids of its own, so requests of a group share it in the prefix
  cache at any block size, and a prompt sent again hits the cache as a whole.
  ``question_len`` and ``output_len`` may vary (``*_std``, ``*_min``, ``*_max``).
* ``data.type: random`` (and ``synthetic``): prompts and outputs drawn from
  ``input_distribution`` and ``output_distribution`` (``min``, ``max``, ``mean``,
  ``std_dev``), every prompt unique.
* ``load.type``: ``constant`` (evenly spaced arrivals at each stage's ``rate``) or
  ``poisson`` (exponential gaps); stages follow one another.

A length distribution is a normal one clipped to its ``min`` (default 1) and ``max``
(default none) and rounded, as inference-perf draws them. Fields kvloop does not model (the
tokenizer, the server, the API type) are ignored; anything else that cannot be read is a
``ValueError`` naming it.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvloop.sim.traces import WorkloadRequest

__all__ = ["Stage", "StagedWorkload", "load_inference_perf", "workload_from_config"]

_ALIASES = {"num_unique_system_prompts": "num_groups",
            "num_users_per_system_prompt": "num_prompts_per_group"}
"""inference-perf's older names of the shared-prefix fields -> the current ones."""
MAX_REQUESTS = 5_000_000
"""Most requests a config may ask for (rate x duration over its stages): a typo in a rate
should be an error, not an hour of building requests."""
_TOKEN_BASE = 1_000
"""Synthetic token ids start here (ids below are left to special tokens)."""


@dataclass(frozen=True)
class Stage:
    """One load stage: requests arrive at ``rate`` per second from ``start_s`` for
    ``duration_s`` seconds."""

    rate: float
    duration_s: float
    start_s: float

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass(frozen=True)
class StagedWorkload:
    """The requests of a config, and the stage each arrived in."""

    requests: list[WorkloadRequest]
    stages: list[Stage]
    stage_of: list[int]
    """``stage_of[i]``: the index in ``stages`` of ``requests[i]``."""
    kind: str
    """The data generator (``shared_prefix``, ``random``)."""


def load_inference_perf(path: str | Path, *, seed: int = 0) -> StagedWorkload:
    """The workload of an inference-perf config file (``.yaml``, ``.yml`` or ``.json``)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the workload file {path}: {exc.strerror}") from None
    if path.suffix.lower() == ".json":
        try:
            config = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{exc.lineno}: not JSON ({exc.msg})") from None
    else:
        import yaml

        try:
            config = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            # NOTE: PyYAML's message spans lines (context, quoted source); the error is one.
            mark = getattr(exc, "problem_mark", None)
            line = f":{mark.line + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ValueError(f"{path}{line}: not YAML ({problem})") from None
    return workload_from_config(config, seed=seed, where=str(path))


def workload_from_config(config: Any, *, seed: int = 0, where: str = "config"
                         ) -> StagedWorkload:
    """The workload of a parsed inference-perf config (a dict with ``data`` and ``load``)."""
    if not isinstance(config, Mapping):
        raise ValueError(f"{where}: an inference-perf config is a mapping with 'data' and "
                         "'load'")
    stages = _stages(_section(config, "load", where), where)
    rng = random.Random(seed)
    arrivals = _arrivals(stages, str(config["load"].get("type", "constant")), rng, where)
    data = _section(config, "data", where)
    kind = str(data.get("type", "")).strip()
    n = len(arrivals)
    if kind == "shared_prefix":
        prompts, outputs = _shared_prefix(_section(data, "shared_prefix", f"{where}: data"),
                                          rng, f"{where}: data.shared_prefix")
        order = list(range(len(prompts)))
        rng.shuffle(order)
        picks = [order[i % len(order)] for i in range(n)]
        pairs = [(prompts[j], outputs[j]) for j in picks]
    elif kind in ("random", "synthetic"):
        ins = _lengths(_section(data, "input_distribution", f"{where}: data"), n, rng,
                       f"{where}: data.input_distribution")
        outs = _lengths(_section(data, "output_distribution", f"{where}: data"), n, rng,
                        f"{where}: data.output_distribution")
        base, pairs = _TOKEN_BASE, []
        for length, out in zip(ins, outs, strict=True):
            pairs.append((range(base, base + length), out))
            base += length
    else:
        raise ValueError(f"{where}: data.type {kind!r} is not supported: use shared_prefix, "
                         "random or synthetic")
    requests = [WorkloadRequest(f"ip-{i}", t, prompt, out)
                for i, ((t, _), (prompt, out)) in enumerate(zip(arrivals, pairs, strict=True))]
    return StagedWorkload(requests, stages, [s for _, s in arrivals], kind)


def _section(parent: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = parent.get(key)
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: '{key}' must be a mapping")
    return value


def _known(d: Mapping[str, Any], keys: set[str], where: str) -> None:
    """A typo in a field the simulator reads must not pass for its default: refuse any key
    of ``d`` outside ``keys``."""
    unknown = sorted(str(k) for k in d if k not in keys)
    if unknown:
        raise ValueError(f"{where}: unknown field{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(repr, unknown))}; the fields read here are "
                         f"{', '.join(sorted(keys))}")


_DISTRIBUTION = {"mean", "std_dev", "std", "min", "max", "total_count"}
"""The fields of an inference-perf length distribution (``total_count`` is not used: the
load decides how many requests there are)."""
_SHARED_PREFIX = {"num_groups", "num_prompts_per_group", "system_prompt_len",
                  "enable_multi_turn_chat",
                  *(f"{name}{suffix}" for name in ("question_len", "output_len")
                    for suffix in ("", "_std", "_min", "_max"))}
"""The fields of inference-perf's shared-prefix data (``enable_multi_turn_chat`` is not
used: every request is one question after its group's system prompt)."""


def _number(d: Mapping[str, Any], key: str, where: str, *, default: float | None = None,
            minimum: float = 0.0) -> float:
    value = d.get(key, default)
    if (isinstance(value, bool) or not isinstance(value, int | float) or not value >= minimum
            or (key in d and not math.isfinite(value))):
        bound = "> 0" if 0 < minimum < 1e-6 else f">= {minimum:g}"
        raise ValueError(f"{where}: '{key}' must be a finite number {bound}, got {value!r}")
    return float(value)


def _stages(load: Mapping[str, Any], where: str) -> list[Stage]:
    raw = load.get("stages")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}: load.stages must be a non-empty list of "
                         "{rate, duration}")
    stages, start = [], 0.0
    for i, s in enumerate(raw):
        if not isinstance(s, Mapping):
            raise ValueError(f"{where}: load.stages[{i}] must be a mapping")
        rate = _number(s, "rate", f"{where}: load.stages[{i}]", minimum=1e-9)
        duration = _number(s, "duration", f"{where}: load.stages[{i}]", minimum=1e-9)
        stages.append(Stage(rate, duration, start))
        start += duration
    return stages


def _arrivals(stages: list[Stage], kind: str, rng: random.Random, where: str
              ) -> list[tuple[float, int]]:
    """(arrival time, stage index) of every request, in time order."""
    if kind not in ("constant", "poisson"):
        raise ValueError(f"{where}: load.type {kind!r} is not supported: constant or poisson")
    expected = sum(s.rate * s.duration_s for s in stages)
    if expected > MAX_REQUESTS:
        raise ValueError(f"{where}: the load stages ask for about {expected:,.0f} requests; "
                         f"the simulator takes at most {MAX_REQUESTS:,} (lower a rate or a "
                         "duration)")
    out = []
    for k, s in enumerate(stages):
        if kind == "constant":
            count = round(s.rate * s.duration_s)
            out += [(s.start_s + i / s.rate, k) for i in range(count)]
            continue
        t = s.start_s + rng.expovariate(s.rate)
        while t < s.end_s:
            out.append((t, k))
            t += rng.expovariate(s.rate)
    return out


def _draw(mean: float, std: float, low: float, high: float, n: int, rng: random.Random
          ) -> list[int]:
    """``n`` lengths: normal(mean, std) clipped to [low, high] and rounded (at least 1)."""
    if std <= 0:
        return [max(1, round(min(max(mean, low), high)))] * n
    return [max(1, round(min(max(rng.gauss(mean, std), low), high))) for _ in range(n)]


def _lengths(d: Mapping[str, Any], n: int, rng: random.Random, where: str) -> list[int]:
    _known(d, _DISTRIBUTION, where)
    mean = _number(d, "mean", where, minimum=1)
    std = _number(d, "std_dev", where, default=_number(d, "std", where, default=0.0))
    low = _number(d, "min", where, default=1.0, minimum=1)
    high = _number(d, "max", where, default=math.inf, minimum=low)
    return _draw(mean, std, low, high, n, rng)


def _shared_prefix(d: Mapping[str, Any], rng: random.Random, where: str
                   ) -> tuple[list[range | list[int]], list[int]]:
    """Every distinct prompt of a shared-prefix config, and its output length."""
    d = {_ALIASES.get(k, k): v for k, v in d.items()}
    _known(d, _SHARED_PREFIX, where)
    groups = int(_number(d, "num_groups", where, minimum=1))
    per_group = int(_number(d, "num_prompts_per_group", where, minimum=1))
    system = int(_number(d, "system_prompt_len", where, minimum=0))

    def dist(name: str) -> list[int]:
        mean = _number(d, name, where, minimum=1)
        std = _number(d, f"{name}_std", where, default=0.0)
        low = _number(d, f"{name}_min", where, default=1.0, minimum=1)
        high = _number(d, f"{name}_max", where, default=math.inf, minimum=low)
        return _draw(mean, std, low, high, groups * per_group, rng)

    questions, outputs = dist("question_len"), dist("output_len")
    prompts: list[range | list[int]] = []
    base = _TOKEN_BASE
    for g in range(groups):
        shared = range(base, base + system)
        base += system
        for p in range(per_group):
            q = questions[g * per_group + p]
            prompts.append([*shared, *range(base, base + q)] if system else range(base, base + q))
            base += q
    return prompts, outputs
