"""How close each kind of kernel gets to a device's peaks, and what the engine adds per step.

Pure stdlib. The numbers come from three places, and each object says which in ``source``:

- *fitted*: least-squares fits to Vidur's public per-operator profiles (A100, A40, H100),
  shipped in ``data/gpu_profiles.json`` and refitted by ``benchmarks/fit_cost_model.py``;
- *derived*: for a GPU without a public profile, the same curves averaged over the
  profiled GPUs. The GEMM curve is a function of arithmetic intensity relative to the
  GPU's ridge point (peak FLOP/s ÷ bandwidth), so it transfers through the GPU's specs;
- *measured*: ``kvloop profile`` on the present device (see :mod:`.calibration`).
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from functools import cache
from importlib import resources
from typing import Any


def _check_fraction(owner: str, name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0.0 < value <= 1.0):
        raise ValueError(f"{owner}.{name} must be in (0, 1], got {value!r}")


def _check_nonneg(owner: str, name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{owner}.{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class GemmCurve:
    """Time of one GEMM from its FLOPs ``F`` and bytes moved ``W`` (a soft roofline)::

        t = launch_s + ((F / (P·compute_fraction))^n + (W / (B·memory_fraction))^n)^(1/n)

    with P peak FLOP/s, B bandwidth and n = ``sharpness``. Far below the ridge point the
    GEMM streams its weights at ``memory_fraction`` of B; far above it computes at
    ``compute_fraction`` of P; near the ridge both costs add up partly (n = 1: fully, n →
    ∞: the plain roofline). As a fraction of the roofline ``max(F/P, W/B)`` this depends
    only on x = (F/W) / (P/B), the arithmetic intensity relative to the ridge point (see
    :meth:`efficiency`), which is how the curve carries over to a GPU with other specs.
    """

    compute_fraction: float
    """Fraction of peak FLOP/s that large, compute-bound GEMMs reach."""
    memory_fraction: float
    """Fraction of memory bandwidth that weight-streaming (small-batch) GEMMs reach."""
    sharpness: float
    """Exponent n >= 1 of the soft maximum at the ridge point."""
    launch_s: float = 0.0
    """Fixed seconds per GEMM kernel."""

    def __post_init__(self) -> None:
        _check_fraction("GemmCurve", "compute_fraction", self.compute_fraction)
        _check_fraction("GemmCurve", "memory_fraction", self.memory_fraction)
        if not (isinstance(self.sharpness, (int, float)) and 1.0 <= self.sharpness <= 64.0):
            raise ValueError(f"GemmCurve.sharpness must be in [1, 64], got {self.sharpness!r}")
        _check_nonneg("GemmCurve", "launch_s", self.launch_s)

    def time(self, flops: float, bytes_moved: float, peak_flops: float, bandwidth: float) -> float:
        """Seconds for one GEMM (the class docstring's formula)."""
        n = self.sharpness
        tc = flops / (peak_flops * self.compute_fraction)
        tm = bytes_moved / (bandwidth * self.memory_fraction)
        return self.launch_s + (tc**n + tm**n) ** (1.0 / n)

    def efficiency(self, x: float) -> float:
        """Fraction of the roofline reached at intensity ``x`` relative to the ridge point
        (launch cost left out): ``max(x, 1) / ((x / c)^n + (1 / m)^n)^(1/n)``."""
        n = self.sharpness
        soft = ((x / self.compute_fraction) ** n + (1.0 / self.memory_fraction) ** n) ** (1 / n)
        return max(x, 1.0) / soft


@dataclass(frozen=True)
class MemoryOp:
    """A memory-bound kernel (norm, RoPE, activation, residual add, embedding, sampling):
    ``t = launch_s + bytes / (B·fraction)``."""

    fraction: float
    """Fraction of memory bandwidth the kernel reaches."""
    launch_s: float = 0.0
    """Fixed seconds per kernel."""

    def __post_init__(self) -> None:
        _check_fraction("MemoryOp", "fraction", self.fraction)
        _check_nonneg("MemoryOp", "launch_s", self.launch_s)

    def time(self, bytes_moved: float, bandwidth: float) -> float:
        return self.launch_s + bytes_moved / (bandwidth * self.fraction)


@dataclass(frozen=True)
class AttentionCurve:
    """Attention kernels over the paged KV cache, by kind (one layer)::

        prefill chunk (c new tokens after p cached, context k = p + c):
            max(F / (P·e_p(k)), (k·kv + c·q) / (B·e_d(k))) + chunk_s
            F = 4·h·d·c·(p + (c+1)/2)     causal query-key pairs, QK^T and PV
        decodes (one token each over contexts k_i):
            Σ (k_i + decode_half_context)·kv / (B·decode_fraction)
        per step with any attention: launch_s

    where ``e_p(k) = prefill_fraction · k / (k + prefill_half_context)`` (short contexts
    leave the tensor cores idle), kv the bytes of one token's K and V in one layer, h the
    query heads per rank and d the head dimension.
    """

    prefill_fraction: float
    """Fraction of peak FLOP/s prefill attention reaches on long contexts, causal FLOPs
    counted (so it must come from causal runs: see ``benchmarks/fit_cost_model.py``)."""
    prefill_half_context: float
    """Context length (tokens) at which prefill attention reaches half of that."""
    decode_fraction: float
    """Fraction of memory bandwidth decode attention reaches reading K and V."""
    decode_half_context: float
    """Per-request fixed work of decode attention, in tokens of KV read (query load,
    output write, split-KV reduction)."""
    launch_s: float = 0.0
    """Fixed seconds per layer of a step that runs attention."""
    chunk_s: float = 0.0
    """Fixed seconds per prefill chunk per layer (varlen scheduling, KV-cache writes)."""

    def __post_init__(self) -> None:
        _check_fraction("AttentionCurve", "prefill_fraction", self.prefill_fraction)
        _check_fraction("AttentionCurve", "decode_fraction", self.decode_fraction)
        for name in ("prefill_half_context", "decode_half_context", "launch_s", "chunk_s"):
            _check_nonneg("AttentionCurve", name, getattr(self, name))


@dataclass(frozen=True)
class DeviceEfficiency:
    """How close every kind of kernel gets to one device's peaks (see the module docstring
    for where the numbers come from)."""

    gemm: GemmCurve
    """Projection GEMMs (QKV, O, gate/up, down) and the LM head."""
    norm: MemoryOp
    """RMSNorm: reads and writes the hidden state."""
    rope: MemoryOp
    """Rotary embedding: reads and writes queries and keys."""
    activation: MemoryOp
    """SwiGLU: reads gate and up, writes their product."""
    residual: MemoryOp
    """Residual add: reads two hidden states, writes one."""
    embedding: MemoryOp
    """Embedding lookup: gathers rows, writes the hidden state."""
    attention: AttentionCurve
    """Attention kernels (prefill chunks and decodes costed apart)."""
    host_link_fraction: float = 0.75
    """Fraction of the host link's line rate a KV swap reaches. nvbandwidth measures 25.1
    GB/s host-to-device on A100 (PCIe Gen4, 32 GB/s: 0.79; NVIDIA/nvbandwidth #42)."""
    source: str = ""
    """Where the numbers come from (fitted, derived or measured, and on what)."""

    def __post_init__(self) -> None:
        _check_fraction("DeviceEfficiency", "host_link_fraction", self.host_link_fraction)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "efficiency") -> DeviceEfficiency:
        """Build from :meth:`to_dict` output; a missing or unknown key is a ValueError
        naming ``where``."""
        parts: dict[str, Any] = {}
        kinds = {"gemm": GemmCurve, "attention": AttentionCurve}
        _expect_keys(d, cls, where)
        for f in fields(cls):
            value = d.get(f.name)
            if f.name in ("host_link_fraction", "source"):
                if value is not None:
                    parts[f.name] = value
                continue
            kind = kinds.get(f.name, MemoryOp)
            if not isinstance(value, dict):
                raise ValueError(f"{where}: '{f.name}' must be an object")
            _expect_keys(value, kind, f"{where}.{f.name}")
            parts[f.name] = kind(**value)
        return cls(**parts)


def _expect_keys(d: object, kind: type, where: str) -> None:
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected an object")
    names = [f.name for f in fields(kind)]
    unknown = sorted(set(d) - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}")
    required = [f.name for f in fields(kind) if f.default is MISSING and f.name not in d]
    if required:
        raise ValueError(f"{where}: missing key(s) {', '.join(required)}")


@dataclass(frozen=True)
class EngineOverhead:
    """Serving-engine time on a step's critical path that no kernel accounts for
    (scheduling, input preparation, output processing, host-device syncs)::

        overhead = step_s + seq_s·S + token_s·T     (S requests, T tokens in the step)
    """

    step_s: float = 0.0
    """Fixed seconds per step."""
    seq_s: float = 0.0
    """Seconds per scheduled request per step."""
    token_s: float = 0.0
    """Seconds per scheduled token per step."""
    source: str = ""
    """Where the figures come from."""
    cuda_graphs: bool = False
    """The engine replays CUDA graphs for decode-only steps, so their batch is padded to a
    captured size (``cost_model.CUDA_GRAPH_SIZES``)."""
    async_scheduling: bool = False
    """The engine decides step N+1 while step N runs (vLLM's async scheduling), so a
    request that arrives during step N is first scheduled in step N+2 (the simulator's
    driver holds it back a step)."""
    frontend_s: float = 0.0
    """Seconds a request spends in the server outside the engine loop: HTTP, tokenization,
    the hand-over to the engine, detokenization and streaming its tokens back. The
    simulator's engine sees each request this long after it was sent, so TTFT and e2e
    latency include it and inter-token gaps do not."""

    def __post_init__(self) -> None:
        for name in ("step_s", "seq_s", "token_s", "frontend_s"):
            _check_nonneg("EngineOverhead", name, getattr(self, name))

    def time(self, num_seqs: int, num_tokens: int) -> float:
        return self.step_s + self.seq_s * num_seqs + self.token_s * num_tokens

    def describe(self) -> str:
        """The three figures in one line and one unit, e.g. ``2820.0 µs/step + 154.1
        µs/request`` (the per-token figure when it is not 0), then the engine's behaviours
        that are on (CUDA graphs, async scheduling, frontend time)."""
        text = f"{self.step_s * 1e6:.1f} µs/step + {self.seq_s * 1e6:.1f} µs/request"
        text += f" + {self.token_s * 1e6:.1f} µs/token" if self.token_s else ""
        behaviour = [name for name, on in (("CUDA graphs", self.cuda_graphs),
                                           ("async scheduling", self.async_scheduling)) if on]
        if self.frontend_s:
            behaviour.append(f"frontend {self.frontend_s * 1e3:.1f} ms")
        return text + (f" ({', '.join(behaviour)})" if behaviour else "")


@cache
def _profiles() -> dict[str, Any]:
    text = resources.files("kvloop.executor.simulated").joinpath("data/gpu_profiles.json")
    return json.loads(text.read_text(encoding="utf-8"))


def fitted_efficiency(profile: str) -> DeviceEfficiency:
    """The shipped fit for one profiled GPU (``a100``, ``a40``, ``h100``) or ``derived``."""
    data = _profiles()["devices"]
    if profile not in data:
        raise ValueError(f"no shipped efficiency profile '{profile}': one of {', '.join(data)}")
    return DeviceEfficiency.from_dict(data[profile], f"gpu_profiles.json[{profile}]")


KVLOOP_OVERHEAD = EngineOverhead(
    step_s=3.57e-4,
    seq_s=1.88e-5,
    token_s=0.0,
    source=(
        "kvloop's engine loop (8.4 µs + 5.9 µs/request) and model runner host work (349 µs + "
        "12.9 µs/request), benchmarks/engine_overhead.py on a 2-core Xeon VM (AVX-512), "
        "2026-11-30, after outputs became deltas; kernel launches not included"
    ),
)
"""kvloop's own engine: nothing of it overlaps the device's work."""


def engine_overhead(name_or_seconds: str) -> EngineOverhead:
    """A preset (``vllm``, ``kvloop``, ``none``) or a number of seconds per step."""
    key = name_or_seconds.strip().lower()
    if key == "vllm":
        d = _profiles()["engine_overhead"]["vllm"]
        return EngineOverhead(**d)
    if key == "kvloop":
        return KVLOOP_OVERHEAD
    if key == "none":
        return EngineOverhead(source="none")
    try:
        seconds = float(key)
    except ValueError:
        raise ValueError(
            "engine overhead must be vllm, kvloop, none or seconds per step; "
            f"got {name_or_seconds!r}"
        ) from None
    return EngineOverhead(step_s=seconds, source=f"{seconds:g} s per step, given")
