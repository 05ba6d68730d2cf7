"""kvloop's host-side cost per step: the source of the simulator's ``kvloop`` preset.

Two parts, each timed with B running decodes and fitted as ``step_s + seq_s·B``:

- the engine loop: ``LLMEngine.step`` (scheduler, update, output handling with the default
  model's incremental detokenizer) over a null executor that samples instantly;
- the model runner's host work: ``TorchModelRunner.execute`` on a one-layer model with
  64-wide hidden states and 512 tokens of vocabulary (its arithmetic is negligible), i.e.
  the step's input tensors, attention metadata, the sampler and output bookkeeping. On a
  GPU the per-layer kernel launches overlap the device's work and are left out;
  ``kvloop profile`` on the GPU measures the whole step.

    python benchmarks/engine_overhead.py [--steps 200] [--model default]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from kvloop.engine.loop_timing import engine_loop_time
from kvloop.engine.model_source import resolve_model
from kvloop.engine.tokenizer import Tokenizer
from kvloop.executor.simulated.fitting import fit_nonnegative
from kvloop.executor.torch.model_runner import TorchModelRunner
from kvloop.executor.torch.profiler import Profiler, ProfileSettings, device_name

BATCHES = [1, 8, 32, 128, 256]


def runner_host_times(folder: Path) -> list[float]:
    """``runner.execute`` of B steady decodes (context ~128) on a negligible model."""
    import torch
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=4096)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    runner = TorchModelRunner(str(folder), dtype="float32", device="cpu", block_size=16,
                              num_gpu_blocks=max(BATCHES) * 16 + 64,
                              max_num_batched_tokens=2048, max_num_seqs=max(BATCHES))
    prof = Profiler(runner, ProfileSettings(max_context=256, budget_s=0.5))
    with torch.inference_mode():
        return [prof.runner_step(prof.spread(128, b), []) for b in BATCHES]


def fit(times: list[float]) -> tuple[float, float]:
    step_s, seq_s = fit_nonnegative([[1.0] * len(BATCHES), BATCHES], times)
    return float(step_s), float(seq_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    import torch

    tokenizer = Tokenizer(resolve_model(args.model))
    loop = [engine_loop_time(b, args.steps, tokenizer, 16) for b in BATCHES]
    with tempfile.TemporaryDirectory() as tmp:
        host = runner_host_times(Path(tmp))
    print(f"kvloop host work per step on {device_name(torch.device('cpu'))}")
    print(f"{'decodes':>8}{'engine loop µs':>16}{'runner host µs':>16}")
    for b, a, r in zip(BATCHES, loop, host, strict=True):
        print(f"{b:8d}{a * 1e6:16.1f}{r * 1e6:16.1f}")
    (ls, lq), (rs, rq) = fit(loop), fit(host)
    print(f"engine loop: {ls * 1e6:.1f} µs/step + {lq * 1e6:.2f} µs/request")
    print(f"runner host: {rs * 1e6:.1f} µs/step + {rq * 1e6:.2f} µs/request")
    print(f"kvloop preset: step_s = {ls + rs:.3g}, seq_s = {lq + rq:.3g}")


if __name__ == "__main__":
    main()
