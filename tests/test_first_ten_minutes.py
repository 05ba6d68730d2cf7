"""A new user's first ten minutes: the README's and the how-to guides' commands run as
written (the GPU JSON they name ships, no two examples write the same file), a converted
model has a readable name, and ``kvloop generate`` says where each sampling setting came
from."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from kvloop.cli import main
from kvloop.cli.generate import sampling_params, show_sampling
from kvloop.cli.main import build_parser
from kvloop.executor.simulated.specs import get_hardware_spec, get_model_spec
from kvloop.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
GUIDES = "\n".join(p.read_text(encoding="utf-8") for p in
                   [ROOT / "README.md", *sorted((ROOT / "docs" / "how-to").glob("*.md")),
                    ROOT / "docs" / "tutorial" / "scheduler-loop.md",
                    ROOT / "docs" / "simulator.md"])
"""The README, the how-to guides, the tutorial and the simulator page: what a new user
types from."""


def _commands(text: str) -> list[list[str]]:
    """Every ``kvloop ...`` command of ``text``'s bash blocks and inline code, as argv."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            for part in line.split("#")[0].split("&&"):
                if part.strip().startswith("kvloop "):
                    found.append(shlex.split(part)[1:])
    for code in re.findall(r"`(kvloop [^`]+)`", text):
        found.append(shlex.split(code)[1:])
    return found


def test_readme_commands_parse() -> None:
    commands = _commands(README)
    assert len(commands) >= 8
    parser = build_parser()
    for argv in commands:
        if "..." in argv or "/" in argv or any("[" in a or "|" in a for a in argv):
            continue
        parser.parse_args(argv)  # exits 2 on a flag or argument that does not exist


def test_readme_examples_write_distinct_files() -> None:
    outputs: dict[str, list[str]] = {}
    for argv in _commands(README):
        for flag in ("--json", "--chrome", "-o", "--trace-out"):
            if flag in argv:
                outputs.setdefault(argv[argv.index(flag) + 1], []).append(" ".join(argv))
    assert outputs
    clashes = {path: cmds for path, cmds in outputs.items()
               if len({c.split()[0] for c in cmds}) > 1}
    assert not clashes, clashes
    export = [a for a in _commands(GUIDES) if a[:2] == ["trace", "export"]]
    assert all(a[-1].endswith(".jsonl") for a in export)  # its input is given


def test_the_gpu_json_the_readme_names_ships(tmp_path: Path) -> None:
    named = sorted(set(re.findall(r"--gpu (\S+\.json)", GUIDES)))
    assert named == ["docs/my-gpu.json"]
    hw = get_hardware_spec(str(ROOT / named[0]))
    assert hw.name == "my-gpu" and hw.peak_flops == 400e12
    assert "simulator.md" in README
    out = tmp_path / "m.json"
    assert main(["simulate", "--model", "llama-3.1-8b", "--gpu", str(ROOT / named[0]),
                 "--num-requests", "20", "--request-rate", "4", "--json", str(out),
                 "--no-progress"]) == 0
    assert json.loads(out.read_text())["completed"] == 20


def test_calibrated_example_is_sized_for_a_cpu() -> None:
    """The calibration guide's profile + simulate example uses --quick's grid and a light
    workload, with the lengths named (the defaults are ShareGPT's, far beyond a 2-core
    CPU)."""
    guide = (ROOT / "docs" / "how-to" / "calibrate.md").read_text(encoding="utf-8")
    block = guide[guide.index("kvloop simulate --calibration calibration.json"):]
    block = block[:block.index("```")]
    for piece in ("--prompt-len 128", "--output-len 64", "--max-num-batched-tokens 512",
                  "--max-num-seqs 16"):
        assert piece in block
    assert "kvloop profile --quick" in guide and "sharegpt" in GUIDES.lower()


def _config(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "max_position_embeddings": 8192,
        "tie_word_embeddings": True}))
    return folder / "config.json"


def test_a_converted_gguf_has_a_readable_name(tmp_path: Path) -> None:
    converted = _config(tmp_path / "bad8a3c4602d479c341dd2c47e8a5ba1-v1")
    assert get_model_spec(str(converted)).name == "llama 135M (converted GGUF bad8a3c4)"
    plain = _config(tmp_path / "SmolLM2-135M")
    assert get_model_spec(str(plain)).name == "SmolLM2-135M"


@pytest.mark.parametrize(("argv", "defaults", "expected"), [
    ([], {"temperature": 0.0, "max_tokens": 64},
     "sampling: temperature=0.0 max_tokens=64 (kvloop's defaults for --model default); "
     "top_p=1.0 top_k=0 min_p=0.0 repetition_penalty=1.0 (vLLM's neutral defaults)"),
    (["--temperature", "0.7"], {"temperature": 0.0, "max_tokens": 64},
     "temperature=0.7 (flags); top_p=1.0 top_k=0 min_p=0.0 repetition_penalty=1.0 (vLLM's "
     "neutral defaults); max_tokens=64 (kvloop's defaults for --model default)"),
    (["--model", "/m"], {"temperature": 0.6, "top_p": 0.9},
     "temperature=0.6 top_p=0.9 (the model's generation_config.json); top_k=0 min_p=0.0 "
     "repetition_penalty=1.0 max_tokens=16 (vLLM's neutral defaults)"),
    (["--generation-config", "vllm"], {},
     "temperature=1.0 top_p=1.0 top_k=0 min_p=0.0 repetition_penalty=1.0 max_tokens=16 "
     "(vLLM's neutral defaults)"),
])
def test_generate_says_where_each_sampling_setting_came_from(argv, defaults, expected) -> None:
    args = build_parser().parse_args(["generate", "--prompt", "x", *argv])
    params = sampling_params(SamplingParams(**defaults), args)
    line = show_sampling(params, args, defaults)
    assert line.startswith("sampling: ") and line.endswith(expected)
