"""``kvloop simulate`` from the command line: output, JSON, and one-line errors."""

import json
import subprocess
import sys

from kvloop.cli import main


def test_simulate_writes_json_and_trace(tmp_path, capsys):
    out, steps = tmp_path / "out.json", tmp_path / "steps.jsonl"
    rc = main(
        [
            "simulate",
            "--model",
            "llama-3.1-8b",
            "--gpu",
            "h100",
            "--trace",
            "azure-conv",
            "--num-requests",
            "200",
            "--json",
            str(out),
            "--trace-out",
            str(steps),
            "--slo-ttft",
            "0.2",
            "--slo-tpot",
            "0.05",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "TTFT" in text and "Prefix cache hit rate" in text
    m = json.loads(out.read_text())
    assert m["completed"] == 200 and m["config"]["trace"] == "azure-conv"
    assert m["goodput"] <= m["request_throughput"]
    assert len(steps.read_text().splitlines()) == m["scheduler"]["num_steps"]


def test_knobs_reach_the_scheduler(tmp_path):
    out = tmp_path / "o.json"
    rc = main(
        [
            "simulate",
            "--model",
            "smollm2-135m",
            "--gpu",
            "l4",
            "--request-rate",
            "50",
            "--num-requests",
            "50",
            "--prompt-len",
            "64:512",
            "--output-len",
            "8:64",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "256",
            "--block-size",
            "32",
            "--no-enable-prefix-caching",
            "--preemption-mode",
            "swap",
            "--num-gpu-blocks",
            "40",
            "--scheduling-policy",
            "priority",
            "--priority-mix",
            "0:1,5:1",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    cfg = json.loads(out.read_text())["config"]
    assert cfg["scheduler"]["max_num_seqs"] == 8
    assert {k: cfg["cache"][k] for k in
            ("block_size", "num_gpu_blocks", "enable_prefix_caching")} == {
        "block_size": 32,
        "num_gpu_blocks": 40,
        "enable_prefix_caching": False,
    }


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "kvloop.cli", "simulate", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,12,x\n")
    cases = [
        (["--model", "gpt-9"], "unknown model"),
        (["--gpu", "tpu-v9"], "unknown hardware"),
        (["--trace", str(bad)], "bad.csv:2"),
        (
            ["--trace", "azure-conv", "--num-requests", "50", "--num-gpu-blocks", "4"],
            "can never run",
        ),
        (["--model", "llama-3.1-70b", "--num-requests", "5"], "tensor-parallel"),
        (["--max-num-seqs", "0", "--num-requests", "5"], "max_num_seqs"),
    ]
    for args, needle in cases:
        r = _cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert needle in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_model_flags_reach_engine_args():
    import argparse

    from kvloop.cli.args import add_model_args, engine_args_from

    p = argparse.ArgumentParser()
    add_model_args(p)
    args = engine_args_from(p.parse_args(["--skip-tokenizer-init", "--max-num-seqs", "3"]))
    assert args.skip_tokenizer_init is True and args.max_num_seqs == 3
    assert engine_args_from(p.parse_args([])).skip_tokenizer_init is False


def test_data_and_expert_parallel_flags(tmp_path, capsys):
    """A mixture-of-experts config from a file, its experts spread over 4 data-parallel
    ranks: 4 replicas run, the JSON says how, and EP without experts is a one-line error."""
    cfg = tmp_path / "Mixtral-8x7B.json"
    cfg.write_text(json.dumps({
        "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "vocab_size": 32000}))
    out = tmp_path / "o.json"
    rc = main(["simulate", "--model", str(cfg), "--gpu", "h100", "-tp", "1", "-dp", "4",
               "--enable-expert-parallel", "--num-requests", "80", "--request-rate", "8",
               "--json", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "4 data-parallel ranks of Mixtral-8x7B on h100" in text
    m = json.loads(out.read_text())
    assert m["completed"] == 80 and m["config"]["data_parallel_size"] == 4
    assert m["config"]["expert_parallel"] is True
    rc = main(["simulate", "--model", "llama-3.1-8b", "--enable-expert-parallel",
               "--num-requests", "10"])
    assert rc == 2 and "expert parallelism needs a mixture-of-experts model" in (
        capsys.readouterr().err)
    rc = main(["simulate", "-dp", "2", "--replicas", "2", "--num-requests", "10"])
    assert rc == 2 and "not with --replicas" in capsys.readouterr().err


def test_the_cost_model_line_names_the_fit_and_whose_specs(capsys):
    """A GPU on another part's fit (h200 on the H100's) says it runs at its own specs."""
    lines = {}
    for gpu in ("h100", "h200", "l40s"):
        assert main(["simulate", "--gpu", gpu, "--num-requests", "10", "--no-progress"]) == 0
        lines[gpu] = next(line for line in capsys.readouterr().out.splitlines()
                          if line.startswith("cost model:"))
    assert "H100 operator profiles" in lines["h200"]
    assert "at the h200's own peak and bandwidth" in lines["h200"]
    assert "own peak" not in lines["h100"] and "own peak" not in lines["l40s"]
    assert "derived" in lines["l40s"]
