"""``kvloop serve``'s one startup line: model, device, dtype, KV
blocks and their memory, the token budget, the URL; printed before serving, after the
loading lines that say whose kernels run and why the budget is what it is."""

from __future__ import annotations

from pathlib import Path

from serverkit import LiveServer, serve_subprocess

from kvloop.cli.args import format_size
from kvloop.cli.serve import startup_line


def test_startup_line_names_what_is_served(server: LiveServer) -> None:
    line = startup_line(server.engine, "tiny (served as tiny-llama)", "http://127.0.0.1:9")
    memory = format_size(server.engine.executor.kv_cache.gpu.nbytes)
    assert line == (
        "kvloop serve: model tiny (served as tiny-llama) on cpu (float32); "
        f"KV cache 128 blocks x 16 tokens = 2048 tokens, {memory}; token budget 512 tokens "
        "per step; max_model_len 256; http://127.0.0.1:9")
    assert "\n" not in line


def test_serve_prints_one_startup_line_before_serving(tiny_model: Path) -> None:
    with serve_subprocess(tiny_model, "--swap-space", "1MiB") as live:
        live.terminate()
        output, _ = live.proc.communicate(timeout=30)
    lines = output.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("kvloop serve: model ")]
    assert len(starts) == 1, output
    assert [line for line in lines if line.startswith("kvloop serve: ")] == [
        lines[starts[0]], "kvloop serve: stopped"], output  # and one line when it stops
    line = lines[starts[0]]
    port = live.url.rsplit(":", 1)[1]
    assert f"model {tiny_model} (served as tiny-llama) on cpu (float32); " in line
    assert "KV cache 128 blocks x 16 tokens = 2048 tokens, " in line
    assert " + 128 swap blocks;" in line  # 1 MiB of 8 KiB blocks
    assert "token budget 512 tokens per step;" in line
    kv = next(text for text in lines if text.startswith("kvloop: KV cache: "))
    assert "512 tokens per step (as given)" in kv  # why: on the line before, once
    assert line.endswith(f"; http://127.0.0.1:{port}")
    running = next(i for i, text in enumerate(lines) if "Uvicorn running on" in text)
    assert starts[0] < running
    loading = next(i for i, text in enumerate(lines) if text.startswith("kvloop: loading "))
    loaded = next(i for i, text in enumerate(lines) if text.startswith("kvloop: loaded in "))
    assert loading < loaded < starts[0], output  # it says what it is doing while it starts


def test_startup_line_names_a_scheduling_policy_other_than_fcfs() -> None:
    from kvloop.cli.serve import policy_note
    from kvloop.config import SchedulerConfig

    assert policy_note(SchedulerConfig()) == ""
    slo = SchedulerConfig(policy="slo", slo_ttft=0.5, slo_tpot=0.05, slo_overload="reject")
    assert policy_note(slo) == ("scheduling policy slo (TTFT target 0.5 s, TPOT target "
                                "0.05 s, overload reject, aging 60 s); ")
    fair = SchedulerConfig(policy="fair", tenant_weights=(("a", 2.0),),
                           cost_aware_preemption=False)
    assert policy_note(fair) == ("scheduling policy fair (weights a=2, newest-first "
                                 "preemption); ")
