"""Least-squares fits of the cost model's curves to measured kernel times.

Used by ``benchmarks/fit_cost_model.py`` (Vidur's public GPU profiles) and by ``kvloop
profile`` (the present device). numpy and scipy live here, never in the simulator's hot
path. Times are fitted in log space (relative errors); a GEMM's error also weighs by the
square root of its time, since what is predicted is a step, and a 10% miss on a 300 µs
projection costs a step more than one on a 5 µs one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, replace

import numpy as np
from scipy.optimize import least_squares, nnls

from kvloop.executor.simulated.calibration import Calibration, Measurements
from kvloop.executor.simulated.cost_model import CostModel
from kvloop.executor.simulated.efficiency import (
    AttentionCurve,
    DeviceEfficiency,
    EngineOverhead,
    GemmCurve,
    MemoryOp,
)
from kvloop.executor.simulated.specs import HardwareSpec, ModelSpec
from kvloop.executor.simulated.tables import StepTables

_INTENSITY_EDGES = (0.0, 0.05, 0.3, 1.0, 3.0, 20.0, np.inf)
"""Regions of arithmetic intensity (relative to the ridge) weighted equally in a GEMM
fit, so the thousands of compute-bound points do not drown the memory-bound ones."""


def fit_gemm_curve(
    flops: Sequence[float],
    bytes_moved: Sequence[float],
    times_s: Sequence[float],
    peak_flops: float,
    bandwidth: float,
) -> tuple[GemmCurve, np.ndarray]:
    """Fit a :class:`GemmCurve` to measured GEMMs; returns it and the relative errors
    (predicted / measured − 1) of every point."""
    f, w, t = (np.asarray(a, dtype=float) for a in (flops, bytes_moved, times_s))
    if not (len(f) == len(w) == len(t)) or len(t) < 4:
        raise ValueError("a GEMM fit needs at least 4 measurements")
    x = (f / w) / (peak_flops / bandwidth)
    region = np.digitize(x, _INTENSITY_EDGES)
    weight = np.sqrt(t / np.median(t)) / np.sqrt(np.bincount(region)[region])
    log_t = np.log(t)

    def predict(p: np.ndarray) -> np.ndarray:
        c, m, n, launch = p
        return launch + ((f / (peak_flops * c)) ** n + (w / (bandwidth * m)) ** n) ** (1 / n)

    fit = least_squares(
        lambda p: weight * (np.log(predict(p)) - log_t),
        x0=[0.7, 0.8, 2.0, 1e-6],
        bounds=([1e-3, 1e-3, 1.0, 0.0], [1.0, 1.0, 16.0, float(np.min(t))]),
    )
    c, m, n, launch = (float(v) for v in fit.x)
    curve = GemmCurve(compute_fraction=c, memory_fraction=m, sharpness=n, launch_s=launch)
    return curve, predict(fit.x) / t - 1


def fit_memory_op(
    bytes_moved: Sequence[float], times_s: Sequence[float], bandwidth: float
) -> tuple[MemoryOp, np.ndarray]:
    """Fit ``t = launch + bytes / (B·fraction)`` (fraction capped at 1); returns the op and
    the relative errors."""
    b, t = np.asarray(bytes_moved, dtype=float), np.asarray(times_s, dtype=float)
    if len(b) < 2:
        raise ValueError("a memory-bound op fit needs at least 2 measurements")
    log_t = np.log(t)
    fit = least_squares(
        lambda p: np.log(p[1] + b / (bandwidth * p[0])) - log_t,
        x0=[0.5, float(np.min(t)) / 2],
        bounds=([1e-4, 0.0], [1.0, float(np.min(t))]),
    )
    op = MemoryOp(fraction=float(fit.x[0]), launch_s=float(fit.x[1]))
    return op, (fit.x[1] + b / (bandwidth * fit.x[0])) / t - 1


def fit_nonnegative(
    columns: Sequence[Sequence[float]], times_s: Sequence[float], *, relative: bool = True
) -> np.ndarray:
    """Non-negative least squares ``times ≈ Σ coef_j · columns[j]``; with ``relative``
    each row is weighted by 1 / time (times must then be positive). Returns the
    coefficients."""
    a = np.asarray(columns, dtype=float).T
    y = np.asarray(times_s, dtype=float)
    if a.shape[0] != len(y) or len(y) < a.shape[1]:
        raise ValueError("need at least as many measurements as coefficients")
    scale = 1.0 / y if relative else np.ones_like(y)
    coef, _ = nnls(a * scale[:, None], y * scale)
    return coef


def fit_calibration(
    m: Measurements,
    model: ModelSpec,
    *,
    block_size: int,
    num_gpu_blocks: int,
    device_memory: int,
    created: str,
) -> Calibration:
    """Turn ``kvloop profile``'s raw timings into a :class:`Calibration`.

    The device's peaks are the best rates measured anywhere (so every fitted fraction is at
    most 1): FLOP/s of the fastest GEMM, bytes/s of the fastest of the streaming copy, the
    weight-streaming GEMMs and decode attention. Then: the GEMM curve over the GEMMs; one
    memory-bound fit for the small ops from what per-token work costs beyond its GEMMs;
    prefill attention's compute fraction, half context and per-chunk cost by least squares
    on the kernel timings; decode attention and the engine overhead on whole runner steps
    (:func:`_fit_steps`).
    """
    layers = model.num_layers
    b = model.dtype_bytes
    kv_layer = 2 * model.kv_heads_per_rank() * model.head_dim * b
    # Decode attention: t = a0 + a1·Σctx + a2·n  (over all layers).
    dec = np.asarray(m.decode_attention, dtype=float)
    a0, a1, a2 = fit_nonnegative([np.ones(len(dec)), dec[:, 1], dec[:, 0]], dec[:, 2])
    a1 = a1 if a1 > 0 else float(np.min(dec[:, 2] / dec[:, 1]))
    gemm_pts = np.asarray([g[1:] for g in m.gemms], dtype=float)
    bandwidth = max(m.bandwidth, float(np.max(gemm_pts[:, 1] / gemm_pts[:, 2])),
                    layers * kv_layer / a1)
    peak = float(np.max(gemm_pts[:, 0] / gemm_pts[:, 2]))
    gemm, _ = fit_gemm_curve(gemm_pts[:, 0], gemm_pts[:, 1], gemm_pts[:, 2], peak, bandwidth)
    # Small ops: per-token work minus the per-layer GEMMs at the same T.
    heads, kvh, d = model.num_heads, model.kv_heads_per_rank(), model.head_dim
    h, inter = model.hidden_size, model.intermediate_size
    small_bytes = ((2 * layers + 1) * 2 * h + layers * 2 * (heads + kvh) * d
                   + layers * 3 * inter + 2 * layers * 3 * h + 2 * h) * b
    kernels = (2 * layers + 1) + layers + layers + 2 * layers + 1
    tokens = [t for t, _ in m.token_work]
    gemm_by_t: dict[int, float] = dict.fromkeys(tokens, 0.0)
    for t, _, _, s in m.gemms:
        gemm_by_t[t] += layers * s
    rest = [(t * small_bytes, s - gemm_by_t[t]) for t, s in m.token_work if s > gemm_by_t[t]]
    if len(rest) >= 2:
        total, _ = fit_memory_op([r[0] for r in rest], [r[1] for r in rest], bandwidth)
    else:
        total = MemoryOp(fraction=1.0)
    small = MemoryOp(fraction=total.fraction, launch_s=total.launch_s / kernels)
    # Prefill attention: t = L·(max(F/(P·e(k)), mem) + chunk_s + launch_s).
    pre = np.asarray(m.prefill_attention, dtype=float)
    launch = a0 / layers
    decode_fraction = min(1.0, layers * kv_layer / (bandwidth * a1))
    half_decode = a2 / a1
    c, p = pre[:, 0], pre[:, 1]
    k = c + p
    flops = 4 * heads * d * c * (p + (c + 1) / 2)
    mem = (k * kv_layer + c * heads * d * b) / (bandwidth * decode_fraction)

    def predict(x: np.ndarray) -> np.ndarray:
        frac, half, chunk = x
        eff = frac * k / (k + half)
        return layers * (np.maximum(flops / (peak * eff), mem) + chunk + launch)

    fit = least_squares(lambda x: np.log(predict(x)) - np.log(pre[:, 2]),
                        x0=[0.3, 64.0, 1e-5],
                        bounds=([1e-4, 0.0, 0.0], [1.0, 1e5, float(np.min(pre[:, 2]))]))
    micro = AttentionCurve(
        prefill_fraction=float(fit.x[0]), prefill_half_context=float(fit.x[1]),
        decode_fraction=decode_fraction, decode_half_context=float(half_decode),
        launch_s=float(launch), chunk_s=float(fit.x[2]),
    )
    tables = StepTables(
        tokens=tuple(tokens), token_time_s=_monotone([s for _, s in m.token_work]),
        seqs=tuple(s for s, _ in m.seq_work), seq_time_s=_monotone([t for _, t in m.seq_work]),
    )

    def device(attention: AttentionCurve, bw: float) -> HardwareSpec:
        eff = DeviceEfficiency(
            gemm=gemm, norm=small, rope=small, activation=small, residual=small,
            embedding=small, attention=attention, host_link_fraction=1.0,
            source=f"kvloop profile on {m.device_name} ({m.dtype}), {created}",
        )
        return HardwareSpec(name=m.device_name, peak_flops=peak, mem_bandwidth=bw,
                            mem_bytes=device_memory, host_link_bandwidth=m.bandwidth / 2,
                            interconnect="pcie4", profile=eff)

    attention, bandwidth, overhead = _fit_steps(m, model, device(micro, bandwidth), tables)
    hardware = device(attention, bandwidth)
    return Calibration(
        device=m.device, device_name=m.device_name, dtype=m.dtype, created=created,
        model=model, hardware=hardware, overhead=overhead, tables=tables,
        block_size=block_size, num_gpu_blocks=num_gpu_blocks, measurements=asdict(m),
    )


def _fit_steps(
    m: Measurements, model: ModelSpec, hardware: HardwareSpec, tables: StepTables
) -> tuple[AttentionCurve, float, EngineOverhead]:
    """Decode attention and the engine overhead, fitted to whole runner steps.

    What a step costs beyond its measured tables and its chunks' attention (from the
    kernel timings) is fitted as ``c0 + c1·S + c2·L·kv·Σ contexts + c3·chunks + c4·T``
    (S requests, T tokens) by non-negative least squares on relative errors (each step
    weighted by 1 / its time): c2 sets the decode-attention bandwidth fraction (the
    bandwidth is raised if needed to keep it <= 1), c3 is added to the per-chunk cost (what
    a prefill chunk costs in a whole step beyond its attention kernel: its group's padding),
    c0, c1 and c4 become the overhead's per-step, per-request and per-token cost (launches,
    per-request attention work, and what a token costs in a whole step beyond the table of
    a one-sequence forward pass), plus the engine loop over a null executor. Steps as the
    runner really runs them, so the parts add up to the whole.

    NOTE: without c3 and with absolute errors, c0 absorbed what mixed steps cost beyond
    their kernels and the largest steps set every coefficient: on two bfloat16 profiles of
    the default model, decode-only steps came out +7% and +22% (median) too expensive,
    +24% and +37% at worst; fitted this way, -1% and -2%, 16% and 15% at worst.
    NOTE: c3 alone, fitted on chunks of 128 tokens and more, took what a chunk costs in
    proportion to its tokens as a fixed 32 ms per chunk (bfloat16, the default model), and
    steps with chunks under 128 tokens came out +30% too expensive (median, 27 served
    steps); hence c4, and runner steps with 16- and 64-token chunks in the profile.
    """
    att = hardware.efficiency().attention
    layers = model.num_layers
    kv_layer = 2 * model.kv_heads_per_rank() * model.head_dim * model.dtype_bytes
    cost = CostModel(model, hardware, tables=tables)
    rows, resid = [], []
    for step in m.runner_steps:
        chunks = [tuple(ch) for ch in step["chunks"]]
        seqs = step["decodes"] + len(chunks)
        tokens = step["decodes"] + sum(ch[0] for ch in chunks)
        parts = cost.breakdown(0, 0, chunks) if chunks else {"attention_prefill": 0.0}
        known = (tables.token_time(tokens) + tables.seq_time(seqs)
                 + parts["attention_prefill"])
        # NOTE: rows weighted by 1 / step time here; fit_nonnegative(relative=True) would
        # weight by 1 / the residual, which is not the step's relative error.
        w = 1.0 / step["s"]
        rows.append((w, w * seqs, w * layers * kv_layer * step["decode_context"],
                     w * len(chunks), w * tokens))
        resid.append(w * (step["s"] - known))
    bandwidth = hardware.mem_bandwidth
    attention = att
    step_s = seq_s = token_s = 0.0
    if len(rows) >= 5:
        c0, c1, c2, c3, c4 = fit_nonnegative(list(zip(*rows, strict=True)), resid,
                                             relative=False)
        step_s, seq_s, token_s = float(c0), float(c1), float(c4)
        attention = replace(att, chunk_s=att.chunk_s + float(c3) / layers)
        if c2 > 0:
            # NOTE: decode attention cannot read faster than the machine: a fit that says
            # it does means the bandwidth was measured low (a busy machine), and it is
            # raised to match at fraction 1 exactly (1 / (c2 · (1 / c2)) can round to
            # 1.0000000000000002, which the curve rightly refuses).
            fraction = min(1.0, 1.0 / (c2 * bandwidth))
            if 1.0 / c2 > bandwidth:
                bandwidth, fraction = 1.0 / c2, 1.0
            attention = replace(attention, decode_fraction=float(fraction),
                                decode_half_context=0.0, launch_s=0.0)
    loop = [0.0, 0.0]
    if m.engine_loop:
        n = [float(s) for s, _ in m.engine_loop]
        loop = list(fit_nonnegative([[1.0] * len(n), n], [t for _, t in m.engine_loop]))
    overhead = EngineOverhead(
        step_s=step_s + float(loop[0]), seq_s=seq_s + float(loop[1]), token_s=token_s,
        source=f"kvloop profile on {m.device_name}: runner steps beyond the model's kernels, "
        "and the engine loop",
    )
    return attention, bandwidth, overhead


def _monotone(times: list[float]) -> tuple[float, ...]:
    """Measured times by growing size, made non-decreasing and positive.

    NOTE: more tokens (or requests) never cost less; a smaller reading is noise (a stall
    in a subtracted part, or a clip at zero), so each entry is raised to the largest before
    it, and leading zeros take the first positive value."""
    out, best = [], 0.0
    for t in times:
        best = max(best, t)
        out.append(best)
    first = next((t for t in out if t > 0), 1e-9)
    return tuple(t if t > 0 else first for t in out)
