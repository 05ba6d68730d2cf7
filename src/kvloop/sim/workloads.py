"""Synthetic workloads: Poisson or gamma arrivals, and fixed, uniform or trace-drawn lengths.

Everything is deterministic for a given seed: arrivals, lengths, priorities and tenants each
draw from their own ``random.Random`` stream derived from the seed (never the global RNG), so
changing the request rate keeps the same prompt and output lengths.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvloop.sampling_params import is_int64
from kvloop.sim.traces import SHIPPED_TRACES, WorkloadRequest, trace_lengths

__all__ = [
    "LengthSpec",
    "WorkloadRequest",
    "apply_priority_mix",
    "apply_tenant_mix",
    "parse_length_spec",
    "parse_priority_mix",
    "parse_tenant_mix",
    "synthetic_workload",
]


@dataclass(frozen=True)
class LengthSpec:
    """How to draw a token length: fixed, uniform in a range, or from a shipped trace.

    Written as a string: ``"512"`` (fixed), ``"128:1024"`` (uniform, inclusive),
    ``"trace:sharegpt"`` (drawn from that trace's lengths) or ``"trace:sharegpt@512"``
    (drawn from the trace, clipped to at most 512).
    """

    low: int = 1
    """Smallest length (the length itself when fixed); unused for trace specs."""
    high: int = 1
    """Largest length, inclusive; unused for trace specs."""
    trace: str | None = None
    """Shipped trace name to draw from, or None for fixed/uniform."""
    cap: int | None = None
    """Upper clip applied to trace-drawn lengths, or None."""

    def __str__(self) -> str:
        if self.trace is not None:
            return f"trace:{self.trace}" + (f"@{self.cap}" if self.cap is not None else "")
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


def _positive_int(text: str, spec: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"bad length spec {spec!r}: {text!r} is not an integer") from None
    if n < 1:
        raise ValueError(f"bad length spec {spec!r}: lengths must be >= 1, got {n}")
    return n


def parse_length_spec(spec: str | int | LengthSpec) -> LengthSpec:
    """Parse ``"512"``, ``"128:1024"``, ``"trace:NAME"`` or ``"trace:NAME@CAP"``.

    Raises ValueError naming the bad spec. Ints and LengthSpecs are accepted as they are.
    """
    if isinstance(spec, LengthSpec):
        return spec
    if isinstance(spec, int):
        spec = str(spec)
    text = spec.strip()
    if text.startswith("trace:"):
        name, sep, cap = text[len("trace:") :].partition("@")
        if name not in SHIPPED_TRACES:
            raise ValueError(
                f"bad length spec {spec!r}: unknown trace {name!r} "
                f"(shipped: {', '.join(SHIPPED_TRACES)})"
            )
        return LengthSpec(trace=name, cap=_positive_int(cap, spec) if sep else None)
    low, sep, high = text.partition(":")
    lo = _positive_int(low, spec)
    hi = _positive_int(high, spec) if sep else lo
    if hi < lo:
        raise ValueError(f"bad length spec {spec!r}: range {lo}:{hi} is empty")
    return LengthSpec(low=lo, high=hi)


def _draw_lengths(
    n: int, prompt: LengthSpec, output: LengthSpec, rng: random.Random
) -> list[tuple[int, int]]:
    """Draw n (prompt, output) pairs; trace pairs stay together when both name one trace."""
    paired = prompt.trace is not None and prompt.trace == output.trace
    pairs = trace_lengths(prompt.trace) if paired else None  # type: ignore[arg-type]

    def draw(spec: LengthSpec, column: int) -> int:
        if spec.trace is None:
            return spec.low if spec.low == spec.high else rng.randint(spec.low, spec.high)
        value = rng.choice(_column(spec.trace, column))
        return value if spec.cap is None else min(value, spec.cap)

    out = []
    for _ in range(n):
        if pairs is not None:
            p, o = rng.choice(pairs)
            if prompt.cap is not None:
                p = min(p, prompt.cap)
            if output.cap is not None:
                o = min(o, output.cap)
            out.append((p, o))
        else:
            out.append((draw(prompt, 0), draw(output, 1)))
    return out


_COLUMNS: dict[tuple[str, int], list[int]] = {}


def _column(trace: str, column: int) -> list[int]:
    key = (trace, column)
    if key not in _COLUMNS:
        _COLUMNS[key] = [pair[column] for pair in trace_lengths(trace)]
    return _COLUMNS[key]


def _arrivals(n: int, request_rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """First request at t=0, then gamma(shape=burstiness) gaps with mean 1/request_rate."""
    if math.isinf(request_rate):
        return [0.0] * n
    scale = 1.0 / (request_rate * burstiness)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.gammavariate(burstiness, scale)
    return times


def synthetic_workload(
    num_requests: int,
    *,
    request_rate: float,
    burstiness: float = 1.0,
    prompt_len: LengthSpec | str | int,
    output_len: LengthSpec | str | int,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Generate ``num_requests`` requests with unique prompts.

    Inter-arrival gaps follow a gamma distribution with shape ``burstiness`` and mean
    ``1 / request_rate`` (``burstiness=1`` is a Poisson process, lower is burstier, as in
    vLLM's ``benchmark_serving --burstiness``); the first request arrives at t=0 and
    ``request_rate=math.inf`` sends all at t=0. Lengths follow the specs (see
    :class:`LengthSpec`). Prompt ``i`` is a ``range`` of ids disjoint from all others.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (math.inf = all at once), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a positive finite number, got {burstiness}")
    pspec, ospec = parse_length_spec(prompt_len), parse_length_spec(output_len)
    times = _arrivals(num_requests, request_rate, burstiness, random.Random(f"arrivals-{seed}"))
    lengths = _draw_lengths(num_requests, pspec, ospec, random.Random(f"lengths-{seed}"))
    out, offset = [], 0
    for i, (t, (p, o)) in enumerate(zip(times, lengths, strict=True)):
        out.append(WorkloadRequest(f"synthetic-{i}", t, range(offset, offset + p), o))
        offset += p
    return out


def parse_priority_mix(spec: str) -> dict[int, float]:
    """Parse ``"0:0.2,1:0.8"`` into ``{0: 0.2, 1: 0.8}`` (priority: relative weight)."""
    mix: dict[int, float] = {}
    for item in spec.split(","):
        prio, sep, weight = item.strip().partition(":")
        try:
            if not sep:
                raise ValueError
            p, w = int(prio), float(weight)
        except ValueError:
            raise ValueError(
                f"bad priority mix {spec!r}: expected 'PRIORITY:WEIGHT,...', got {item!r}"
            ) from None
        if not is_int64(p):
            raise ValueError(f"bad priority mix {spec!r}: priority {p} is outside 64 bits "
                             "([-2^63, 2^63 - 1])")
        if p in mix:
            raise ValueError(f"bad priority mix {spec!r}: priority {p} is given twice")
        mix[p] = w
    _check_mix(mix, spec)
    return mix


def _check_mix(mix: dict[int, float], spec: object) -> None:
    if not mix or any(not (w >= 0 and math.isfinite(w)) for w in mix.values()):
        raise ValueError(f"bad priority mix {spec!r}: weights must be finite and >= 0")
    if sum(mix.values()) <= 0:
        raise ValueError(f"bad priority mix {spec!r}: weights must not all be 0")


def apply_priority_mix(
    requests: Sequence[WorkloadRequest], mix: dict[int, float], seed: int = 0
) -> None:
    """Set each request's priority at random, priority ``p`` with weight ``mix[p]``.

    Weights are relative (they need not sum to 1). Deterministic for a given seed.
    """
    _check_mix(mix, mix)
    rng = random.Random(f"priorities-{seed}")
    prios, weights = list(mix), list(mix.values())
    for req, prio in zip(requests, rng.choices(prios, weights, k=len(requests)), strict=True):
        req.priority = prio


def tenant_name(index: int) -> str:
    """The name ``--tenant-mix`` gives its ``index``-th share: ``t0``, ``t1``, ..."""
    return f"t{index}"


def parse_tenant_mix(spec: str) -> list[float]:
    """Parse ``"0.6,0.05,0.05"`` into ``[0.6, 0.05, 0.05]``: tenant ``t<i>``'s share.

    Shares are relative weights (they need not sum to 1); each must be finite and >= 0 and
    not all 0. Raises ValueError naming the bad spec and item.
    """
    shares: list[float] = []
    for item in spec.split(","):
        try:
            share = float(item.strip())
        except ValueError:
            raise ValueError(
                f"bad tenant mix {spec!r}: expected comma-separated shares such as "
                f"'0.6,0.2,0.2', got {item.strip()!r}"
            ) from None
        if not (share >= 0 and math.isfinite(share)):
            raise ValueError(f"bad tenant mix {spec!r}: shares must be finite and >= 0, "
                             f"got {item.strip()!r}")
        shares.append(share)
    if sum(shares) <= 0:
        raise ValueError(f"bad tenant mix {spec!r}: shares must not all be 0")
    return shares


def apply_tenant_mix(
    requests: Sequence[WorkloadRequest], shares: Sequence[float], seed: int = 0
) -> None:
    """Set each request's tenant at random: ``t<i>`` (:func:`tenant_name`) with weight
    ``shares[i]``. Deterministic for a given seed, from its own random stream (so it does not
    change arrivals, lengths or priorities)."""
    if not shares or any(not (w >= 0 and math.isfinite(w)) for w in shares) or sum(shares) <= 0:
        raise ValueError(f"bad tenant mix {list(shares)!r}: shares must be finite, >= 0 and "
                         "not all 0")
    rng = random.Random(f"tenants-{seed}")
    names = [tenant_name(i) for i in range(len(shares))]
    for req, name in zip(requests, rng.choices(names, shares, k=len(requests)), strict=True):
        req.tenant = name
