"""A model folder with a real model's shapes and random weights, for timing runs.

Reads ``SRC/config.json`` (a Hugging Face Llama / Qwen2 / Mistral config), initialises the
model with random weights through transformers, and saves it to ``OUT`` as safetensors,
copying the tokenizer files next to it when ``SRC`` has them. Speed depends only on the
shapes, so ``kvloop profile`` and the benchmarks measure such a folder exactly as the real
model (their prompts are random token ids and their outputs forced to a length).

    python benchmarks/random_model.py SRC OUT [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
import transformers

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src", type=Path, help="folder with config.json (and a tokenizer)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    config = transformers.AutoConfig.from_pretrained(args.src)
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch,
                                                                                 args.dtype))
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    for name in TOKENIZER_FILES:
        if (args.src / name).exists():
            shutil.copy(args.src / name, args.out / name)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {config.model_type}, {n / 1e6:.1f}M random {args.dtype} weights")


if __name__ == "__main__":
    main()
