"""Shipped efficiency curves (fitted to Vidur's profiles), the fitting code, network tables."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from kvloop.executor.simulated import (
    HARDWARE_PRESETS,
    DeviceEfficiency,
    GemmCurve,
    MemoryOp,
    fitted_efficiency,
    get_hardware_spec,
)
from kvloop.executor.simulated.fitting import fit_gemm_curve, fit_memory_op, fit_nonnegative
from kvloop.executor.simulated.network import AllReduceTable, allreduce_model, interconnects

PROFILES = ("a100", "a40", "h100", "derived")
SMALL_OPS = ("norm", "rope", "activation", "residual", "embedding")


def _shipped() -> dict:
    path = resources.files("kvloop.executor.simulated").joinpath("data/gpu_profiles.json")
    return json.loads(path.read_text())


@pytest.mark.parametrize("name", PROFILES)
def test_shipped_curves_are_fractions_and_efficiency_stays_in_0_1(name: str) -> None:
    eff = fitted_efficiency(name)
    g = eff.gemm
    assert 0 < g.compute_fraction <= 1 and 0 < g.memory_fraction <= 1 and g.sharpness >= 1
    xs = np.logspace(-3, 3, 200)
    e = [g.efficiency(x) for x in xs]
    assert all(0 < v <= 1 for v in e)
    # Far below the ridge the curve streams at the memory fraction; far above it computes
    # at the compute fraction; the ridge itself costs the most.
    assert e[0] == pytest.approx(g.memory_fraction, rel=1e-3)
    assert e[-1] == pytest.approx(g.compute_fraction, rel=1e-3)
    assert g.efficiency(1.0) <= min(e) + 1e-12
    for op in SMALL_OPS:
        assert 0 < getattr(eff, op).fraction <= 1
    a = eff.attention
    assert 0 < a.prefill_fraction <= 1 and 0 < a.decode_fraction <= 1
    assert eff.source


@pytest.mark.parametrize("gpu", sorted(HARDWARE_PRESETS))
def test_gemm_time_and_rate_are_monotone_in_tokens(gpu: str) -> None:
    hw = get_hardware_spec(gpu)
    g = hw.efficiency().gemm
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        prev_t, prev_rate = 0.0, 0.0
        for m in (1, 2, 8, 32, 128, 512, 2048, 8192, 32768):
            f, w = 2.0 * m * n * k, 2.0 * (n * k + m * k + m * n)
            t = g.time(f, w, hw.peak_flops, hw.mem_bandwidth)
            rate = f / t
            assert t > prev_t and rate >= prev_rate
            assert rate <= hw.peak_flops * g.compute_fraction * (1 + 1e-9)
            assert w / t <= hw.mem_bandwidth  # never faster than the datasheet
            prev_t, prev_rate = t, rate


def test_derived_is_the_average_of_the_profile_fits() -> None:
    fits = [fitted_efficiency(n) for n in ("a100", "a40", "h100")]
    derived = fitted_efficiency("derived")
    for field in ("compute_fraction", "memory_fraction"):
        mean = statistics.fmean(getattr(f.gemm, field) for f in fits)
        assert getattr(derived.gemm, field) == pytest.approx(mean)
    # NOTE: a sharpness fitted to serving runs replaces the profile's for its GPU only; the
    # average is of what the profiles say
    quality = _shipped()["fit_quality"]
    profile = [quality[n].get("gemm_profile_sharpness", f.gemm.sharpness)
               for n, f in zip(("a100", "a40", "h100"), fits, strict=True)]
    assert derived.gemm.sharpness == pytest.approx(statistics.fmean(profile))
    assert quality["h100"]["gemm_profile_sharpness"] != fitted_efficiency("h100").gemm.sharpness
    assert derived.norm.fraction == pytest.approx(statistics.fmean(f.norm.fraction for f in fits))


def test_presets_use_their_own_fit_or_the_derived_curve() -> None:
    for gpu in ("h100", "h200", "gh200"):  # one chip
        assert get_hardware_spec(gpu).efficiency() == fitted_efficiency("h100")
    assert get_hardware_spec("a100-80gb").efficiency() == fitted_efficiency("a100")
    for gpu in ("l4", "l40s", "b200", "rtx-4090", "rtx-pro-6000"):
        assert get_hardware_spec(gpu).efficiency() == fitted_efficiency("derived")


def test_fit_quality_is_recorded_and_good() -> None:
    quality = _shipped()["fit_quality"]
    for gpu in ("a100", "a40", "h100"):
        assert quality[gpu]["gemm_points"] > 1000
        assert quality[gpu]["gemm_median_abs_error"] < 0.10
        assert abs(quality[gpu]["gemm_median_error_below_ridge"]) < 0.10
    # NOTE: the H100's shipped sharpness is the serving runs', not its profile's: against the
    # profile's GEMMs it misses more, and the record says by how much
    h100 = quality["h100"]
    assert h100["gemm_profile_sharpness"] != fitted_efficiency("h100").gemm.sharpness
    assert h100["gemm_median_abs_error"] < h100["gemm_median_abs_error_shipped"] < 0.15


def test_efficiency_round_trips_and_rejects_bad_values() -> None:
    eff = fitted_efficiency("h100")
    assert DeviceEfficiency.from_dict(eff.to_dict()) == eff
    with pytest.raises(ValueError, match="compute_fraction"):
        GemmCurve(compute_fraction=1.5, memory_fraction=0.5, sharpness=2)
    with pytest.raises(ValueError, match="sharpness"):
        GemmCurve(compute_fraction=0.5, memory_fraction=0.5, sharpness=0.5)
    with pytest.raises(ValueError, match="launch_s"):
        MemoryOp(0.5, launch_s=-1)
    with pytest.raises(ValueError, match="unknown key"):
        DeviceEfficiency.from_dict({**eff.to_dict(), "turbo": True})
    with pytest.raises(ValueError, match="no shipped efficiency profile"):
        fitted_efficiency("b200")


# --- the fitting code recovers what made the data ----------------------------------------


def test_fit_gemm_curve_recovers_its_parameters() -> None:
    truth = GemmCurve(compute_fraction=0.7, memory_fraction=0.85, sharpness=1.6, launch_s=4e-6)
    peak, bw = 300e12, 2e12
    f, w = [], []
    for n, k in ((6144, 4096), (28672, 4096), (4096, 14336)):
        for m in (1, 4, 16, 64, 128, 256, 512, 1024, 4096, 16384):
            f.append(2.0 * m * n * k)
            w.append(2.0 * (n * k + m * k + m * n))
    t = [truth.time(a, b, peak, bw) for a, b in zip(f, w, strict=True)]
    fit, err = fit_gemm_curve(f, w, t, peak, bw)
    assert fit.compute_fraction == pytest.approx(0.7, rel=0.02)
    assert fit.memory_fraction == pytest.approx(0.85, rel=0.02)
    assert fit.sharpness == pytest.approx(1.6, rel=0.05)
    assert np.max(np.abs(err)) < 0.01


def test_fit_memory_op_and_nonnegative() -> None:
    nbytes = [1e3, 1e5, 1e7, 1e9]
    op, _ = fit_memory_op(nbytes, [MemoryOp(0.6, 3e-6).time(b, 1e12) for b in nbytes], 1e12)
    assert op.fraction == pytest.approx(0.6, rel=0.01)
    assert op.launch_s == pytest.approx(3e-6, rel=0.05)
    coef = fit_nonnegative([[1, 1, 1], [1, 2, 3]], [2.0, 3.0, 4.0])
    assert coef == pytest.approx([1.0, 1.0], abs=1e-6)


# --- all-reduce tables ------------------------------------------------------------------------


def test_shipped_interconnects_and_their_tables() -> None:
    assert interconnects() == ["nvlink3", "nvlink4", "nvlink5", "pcie4", "pcie5"]
    for name in interconnects():
        model = allreduce_model(name, 4)
        table = model.table
        assert table.num_workers == 4
        for size, t in zip(table.sizes, table.times_s, strict=True):
            nccl = t if name != "nvlink5" else model.time(size)
            assert model.time(size) <= nccl * (1 + 1e-9)  # the faster of the two
            if size > model.custom_max_bytes or model.custom is None:
                assert model.time(size) == pytest.approx(nccl)  # exact at measured points
        sizes = [2**i for i in range(8, 32)]
        times = [model.time(s) for s in sizes]
        assert times == sorted(times)
    # NVLink4 moves 64 MiB faster than PCIe Gen4 does.
    assert allreduce_model("nvlink4", 2).time(64 << 20) < allreduce_model("pcie4", 2).time(
        64 << 20)


def test_the_custom_allreduce_serves_small_messages_over_nvlink() -> None:
    """Below 8 MiB over NVLink a step pays vLLM's custom all-reduce (the published H100
    figures), not Vidur's NCCL times with their launch; PCIe has no custom one."""
    h100 = allreduce_model("nvlink4", 2)
    assert h100.time(256 << 10) == pytest.approx(7.9e-6)  # published: 7.9 µs at TP 2
    assert h100.time(256 << 10) < h100.table.time(256 << 10) / 4  # NCCL's: ~42 µs
    assert h100.time(64 << 20) <= h100.table.time(64 << 20)
    assert allreduce_model("pcie5", 2).custom is None
    # NVLink 3 (A100) is slower, NVLink 5 (B200) faster, on the bandwidth-bound part
    big = 6 << 20
    assert allreduce_model("nvlink3", 2).time(big) > h100.time(big) > allreduce_model(
        "nvlink5", 2).time(big)


def test_the_fused_allreduce_serves_hopper_up_to_its_limit_per_gpu_count() -> None:
    """vLLM's in-graph fused all-reduce (published H100 figures at 2 GPUs: 6.98 µs for
    6 x 6144 bf16, 12.98 µs for 138 x 6144) takes 64 MiB at 2 GPUs, 2 MiB at 4, 512 KiB
    at 8; a one-shot all-reduce reads n−1 peers."""
    two, four, eight = (allreduce_model("nvlink4", n) for n in (2, 4, 8))
    big = 138 * 6144 * 2
    assert two.time(big) == pytest.approx(12.98e-6)  # the custom one's: ~30 µs
    assert two.time(6 * 6144 * 2) < 6.98e-6  # small: the custom one is faster
    assert four.time(1 << 20) == pytest.approx(6.98e-6 + 3 * (two.time(1 << 20) - 6.98e-6))
    assert four.time(1 << 20) < allreduce_model("nvlink4", 4, fused=False).time(1 << 20)
    # past 512 KiB at 8 GPUs vLLM leaves the fused kernel: the custom one's published time
    assert eight.time(1 << 20) == pytest.approx(33.8e-6)
    assert eight.time(1 << 20) == allreduce_model("nvlink4", 8, fused=False).time(1 << 20)
    # only Hopper fuses: A100 (nvlink3) and PCIe never take it, nor 3 or 16 GPUs
    assert allreduce_model("nvlink3", 2).fused is None
    assert allreduce_model("pcie5", 2).fused is None
    assert allreduce_model("nvlink4", 16).fused is None


def test_worker_counts_without_a_table_scale_by_the_ring_factor() -> None:
    four = allreduce_model("pcie5", 4)
    two = allreduce_model("pcie5", 2)  # only a 4-worker PCIe table is shipped
    assert two.table.num_workers == 4
    floor = four.table.times_s[0]
    big = 256 << 20
    assert two.time(big) - floor == pytest.approx((four.time(big) - floor) * (1.0 / 1.5))
    with pytest.raises(ValueError, match="unknown interconnect"):
        allreduce_model("infiniband", 2)


def test_table_interpolates_log_log_and_extrapolates_linearly() -> None:
    table = AllReduceTable("toy", 2, (1000, 4000, 16000), (1e-5, 2e-5, 8e-5))
    assert table.time(500) == 1e-5
    assert table.time(2000) == pytest.approx(math.sqrt(1e-5 * 2e-5))
    assert table.time(32000) == pytest.approx(8e-5 + (6e-5 / 12000) * 16000)
    with pytest.raises(ValueError, match="ascending"):
        AllReduceTable("toy", 2, (4000, 1000), (1e-5, 2e-5))


ROOT = Path(__file__).resolve().parents[2]
VIDUR = ROOT.parent / "shared/calibration/vidur"


@pytest.mark.skipif(not VIDUR.is_dir(), reason="Vidur's public profiles are not beside the repo")
def test_the_shipped_curves_are_what_the_fit_writes() -> None:
    """gpu_profiles.json and network.json are benchmarks/fit_cost_model.py's output from
    Vidur's profiles and its named constants, not edited by hand."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks/fit_cost_model.py"),
                          "--check", "--vidur", str(VIDUR)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
