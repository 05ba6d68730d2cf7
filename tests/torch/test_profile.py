"""``kvloop profile`` on a tiny model: a calibration in seconds that the simulator uses."""

from __future__ import annotations

import json

from conftest import TinyModel  # noqa: F401  (fixtures come from conftest)
from kvloop.cli import main
from kvloop.executor.simulated.calibration import Calibration


def test_profile_writes_a_calibration_the_simulator_uses(llama_model, tmp_path, capsys,
                                                         monkeypatch):
    from kvloop.executor.torch import profiler

    measure = profiler.measure_bandwidth
    calls: list[float] = []

    def noisy(device):  # the real bandwidth, with repeats as far apart as on a busy machine
        bandwidth, _ = measure(device)
        calls.append(bandwidth)
        return bandwidth, 0.6

    monkeypatch.setattr(profiler, "measure_bandwidth", noisy)
    out = tmp_path / "cal.json"
    rc = main(["profile", "--model", str(llama_model.path), "--device", "cpu", "--dtype",
               "float32", "--quick", "--block-size", "4", "--kv-cache-memory", str(64 << 20),
               "-o", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    assert "kvloop simulate --calibration" in captured.out
    # stderr is not a terminal here: one plain line per measured item instead of a bar
    lines = [ln for ln in captured.err.splitlines() if ln.startswith("kvloop profile: [")]
    assert lines[0].startswith("kvloop profile: [1/") and "per-token work, 1 tokens" in lines[0]
    total = int(lines[0].split("/")[1].split("]")[0])
    assert len(lines) == total and lines[-1].startswith(f"kvloop profile: [{total}/{total}]")
    assert "repeats 60% apart" in captured.err
    assert "looks busy" in captured.err and "calibration is noisy" in captured.err
    assert len(calls) == 2  # at the start, and again at the end to see whether it moved
    assert Calibration.load(out).measurements["bandwidth"] == calls[0]
    cal = Calibration.load(out)
    assert cal.device == "cpu" and cal.dtype == "float32" and "threads" in cal.device_name
    assert cal.model.num_layers == 3 and cal.model.dtype_bytes == 4
    assert cal.tables.tokens[0] == 1 and cal.tables.tokens[-1] == 512
    assert all(t > 0 for t in cal.tables.token_time_s)
    eff = cal.hardware.efficiency()
    for fraction in (eff.gemm.compute_fraction, eff.gemm.memory_fraction,
                     eff.attention.prefill_fraction, eff.attention.decode_fraction):
        assert 0 < fraction <= 1
    raw = cal.measurements
    assert raw["decode_attention"] and raw["prefill_attention"] and raw["runner_steps"]
    assert raw["engine_loop"]
    # The profiled model's own steps cost what was measured, within the fit's noise: --quick
    # times each item a few times only, and a shared CI machine can stall any of them, so
    # this checks the scale (a unit is off by 1000x, a dropped term makes it too cheap), not
    # accuracy (the step fit's own tests in tests/executor/test_calibration.py do). NOTE:
    # the upper bound is loose: under one busy loop on 2 cores the tables of this 3-layer
    # model were timed up to 8x slower than its whole steps, and the fit only adds
    # non-negative terms to them; the lower bound stays tight.
    cm = cal.cost_model()
    steps = raw["runner_steps"]
    predicted = [cm.step_time(s["decodes"], s["decode_context"], [tuple(c) for c in s["chunks"]])
                 for s in steps]
    ratios = sorted(p / s["s"] for p, s in zip(predicted, steps, strict=True))
    assert 0.4 < ratios[len(ratios) // 2] < 20, ratios
    assert 0.3 < sum(predicted) / sum(s["s"] for s in steps) < 20, ratios

    metrics = tmp_path / "m.json"
    rc = main(["simulate", "--calibration", str(out), "--num-requests", "20",
               "--request-rate", "5", "--prompt-len", "8:100", "--output-len", "2:20",
               "--max-model-len", "256", "--json", str(metrics), "--no-progress"])
    assert rc == 0
    assert json.loads(metrics.read_text())["completed"] == 20


def test_profile_rejects_bad_flags(tmp_path, capsys):
    assert main(["profile", "--max-num-seqs", "0", "-o", str(tmp_path / "c.json")]) == 2
    assert "--max-num-seqs must be >= 1" in capsys.readouterr().err
    assert main(["profile", "-o", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_robust_mean_drops_stalls_but_keeps_slow_runs():
    from kvloop.executor.torch.profiler import robust_mean

    assert robust_mean([1.0, 1.0, 1.0, 1.0, 50.0]) == 1.0  # a stall is not the step's cost
    assert robust_mean([1.0, 1.0, 1.0, 2.0, 2.0]) == 1.4  # a slow run is


def test_profile_token_budget_records_what_later_starts_read(llama_model, capsys):
    from kvloop.engine.args import EngineArgs
    from kvloop.engine.llm_engine import LLMEngine
    from kvloop.executor.torch import budget

    argv = ["profile", "--token-budget", "--model", str(llama_model.path), "--device", "cpu",
            "--dtype", "float32"]
    assert main(argv) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("kvloop profile: ") and "measured now" in line
    recorded = line.rsplit("; recorded in ", 1)[1]
    assert recorded.startswith(str(budget.records_dir()))
    chosen = int(line.split()[2])
    engine = LLMEngine.from_args(EngineArgs(
        model=str(llama_model.path), dtype="float32", device="cpu", num_gpu_blocks=64,
        swap_space=0.0, skip_tokenizer_init=True))
    assert engine.scheduler.config.max_num_batched_tokens == chosen
    assert "on this machine" in engine.token_budget_note
