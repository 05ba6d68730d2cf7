"""``kvloop generate``: one or more prompts through the real engine, completions printed."""

from __future__ import annotations

import argparse
import json
import sys

from kvloop.cli.args import add_model_args, engine_args_from
from kvloop.sampling_params import SamplingParams


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate completions with a real model",
        description="Generate with kvloop's engine (default: the embedded SmolLM2-135M).",
    )
    p.add_argument("--prompt", action="append", required=True,
                   help="a prompt (repeat for a batch); with --skip-tokenizer-init, token ids "
                   "separated by commas or spaces")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--trace-out", default=None, metavar="PATH",
                   help="write one step record per line (JSONL)")
    add_model_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvloop.engine.llm import LLM

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )
    ea = engine_args_from(args)
    prompts: list = args.prompt
    if ea.skip_tokenizer_init:
        if args.chat:
            print("kvloop: error: --chat needs a tokenizer (drop --skip-tokenizer-init)",
                  file=sys.stderr)
            return 2
        try:
            prompts = [[int(t) for t in p.replace(",", " ").split()] for p in args.prompt]
        except ValueError:
            print("kvloop: error: --prompt must be token ids (e.g. 1,2,3) with "
                  "--skip-tokenizer-init", file=sys.stderr)
            return 2
    llm = LLM(**vars(ea), trace_out=args.trace_out)
    if args.chat:
        convs = []
        for prompt in args.prompt:
            msgs = [{"role": "system", "content": args.system}] if args.system else []
            convs.append([*msgs, {"role": "user", "content": prompt}])
        outputs = llm.chat(convs, params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.close()
    for out in outputs:
        if args.json:
            m = out.metrics
            print(
                json.dumps(
                    {
                        "text": out.text,
                        "token_ids": out.token_ids,
                        "finish_reason": out.finish_reason,
                        "ttft_s": m.ttft if m else None,
                        "tpot_s": m.tpot if m else None,
                        "e2e_s": m.e2e if m else None,
                    }
                )
            )
        elif ea.skip_tokenizer_init:
            print(" ".join(map(str, out.token_ids or [])))
        else:
            print(out.text)
        if out.error:
            print(f"kvloop: error: {out.error}", file=sys.stderr)
            return 1
    return 0
