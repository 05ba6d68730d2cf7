"""``kvloop generate``: one or more prompts through the real engine, completions printed.

One prompt streams its text to stdout as it is generated; a batch prints each completion
when it finishes (``[i] text``, ``i`` the prompt's index). Start-up phases (converting a GGUF
file once, loading, the KV cache) and the sampling settings in effect are one line each on
stderr, as is a ``[length]`` note for a reply cut by ``--max-tokens``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields, replace
from typing import IO, Any

from kvloop.cli.args import (
    add_model_args,
    check_max_tokens_early,
    check_prompts_early,
    engine_args_from,
)
from kvloop.cli.status import status_to_stderr
from kvloop.engine.generation_config import DEFAULT_MODEL_GENERATION_CONFIG
from kvloop.sampling_params import SamplingParams

_NEUTRAL = SamplingParams()
# flag -> SamplingParams field, for the flags whose default is the generation config's
_SAMPLING_FLAGS = {
    "max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
    "top_k": "top_k", "min_p": "min_p", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "repetition_penalty": "repetition_penalty",
    "sampling_seed": "seed", "logprobs": "logprobs",
}
_SHOWN = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")


def _default(name: str) -> str:
    """Help text for a flag whose default comes from the generation config."""
    value = getattr(_NEUTRAL, name)
    model = DEFAULT_MODEL_GENERATION_CONFIG.get(
        "max_new_tokens" if name == "max_tokens" else name)
    own = f"; --model default: {model}" if model is not None else ""
    return f"(default: the model's generation config{own}; else {value})"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate completions with a real model",
        description="Generate with kvloop's engine (default: the embedded SmolLM2-135M). "
        "Sampling flags left out take the model's defaults from its generation_config.json "
        "(--generation-config auto), else vLLM's neutral ones (--generation-config vllm).",
    )
    p.add_argument("--prompt", action="append", required=True,
                   help="a prompt (repeat for a batch); with --skip-tokenizer-init, token ids "
                   "separated by commas or spaces")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat (default: none)")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help=f"most tokens to generate {_default('max_tokens')}")
    s.add_argument("--temperature", type=float, default=None, metavar="T",
                   help=f"0 for greedy {_default('temperature')}")
    s.add_argument("--top-p", type=float, default=None, metavar="P", help=_default("top_p"))
    s.add_argument("--top-k", type=int, default=None, metavar="K",
                   help=f"0 or -1: all tokens {_default('top_k')}")
    s.add_argument("--min-p", type=float, default=None, metavar="P", help=_default("min_p"))
    s.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                   help=_default("repetition_penalty"))
    s.add_argument("--presence-penalty", type=float, default=None, metavar="X",
                   help=f"(default: {_NEUTRAL.presence_penalty})")
    s.add_argument("--frequency-penalty", type=float, default=None, metavar="X",
                   help=f"(default: {_NEUTRAL.frequency_penalty})")
    s.add_argument("--sampling-seed", type=int, default=None,
                   help="per-request seed (default: the engine's --seed)")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    s.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="print each output token's log-probability and the top N "
                   "alternatives (in --json too) (default: none)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt (as each finishes)")
    p.add_argument("--trace-out", default=None, metavar="PATH",
                   help="write one step record per line (JSONL) (default: none)")
    add_model_args(p)
    p.set_defaults(func=run)


def sampling_params(defaults: SamplingParams, args: argparse.Namespace) -> SamplingParams:
    """``defaults`` (the model's) with every sampling flag that was given set over them."""
    given = {field: getattr(args, flag) for flag, field in _SAMPLING_FLAGS.items()
             if getattr(args, flag) is not None}
    if args.stop:
        given["stop"] = list(args.stop)
    if args.ignore_eos:
        given["ignore_eos"] = True
    known = {f.name for f in fields(SamplingParams)}
    return replace(defaults, **{k: v for k, v in given.items() if k in known})


def show_sampling(params: SamplingParams, args: argparse.Namespace,
                  from_config: dict[str, Any]) -> str:
    """The status line naming the sampling settings in effect, each group with where it came
    from: a flag, the model's generation config (``from_config``, the engine's
    ``default_sampling``; for ``--model default`` under ``auto``, kvloop's own defaults for
    it unless its folder's file says otherwise), or vLLM's neutral defaults."""
    given = {field for flag, field in _SAMPLING_FLAGS.items()
             if getattr(args, flag, None) is not None}
    config = str(getattr(args, "generation_config", "auto"))
    own = (DEFAULT_MODEL_GENERATION_CONFIG
           if getattr(args, "model", None) == "default" and config == "auto" else {})
    if config == "auto":
        file = "the model's generation_config.json"
    else:
        file = f"--generation-config {config}"

    def origin(name: str) -> str:
        if name in given:
            return "flags"
        if name not in from_config:
            return "vLLM's neutral defaults"
        key = "max_new_tokens" if name == "max_tokens" else name
        if own.get(key) == from_config[name]:
            return "kvloop's defaults for --model default"
        return file

    groups: dict[str, list[str]] = {}
    for name in _SHOWN:
        groups.setdefault(origin(name), []).append(f"{name}={getattr(params, name)}")
    return "sampling: " + "; ".join(f"{' '.join(v)} ({k})" for k, v in groups.items())


def run(args: argparse.Namespace) -> int:
    from kvloop.engine.llm import LLM

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
    sampling_params(SamplingParams(), args)  # bad flags fail now, not after loading
    check_max_tokens_early(args)  # NOTE: from config.json, before torch is imported
    check_prompts_early(args, prompts)
    with status_to_stderr():
        llm = LLM(**vars(ea), trace_out=args.trace_out)
    params = sampling_params(llm.get_default_sampling_params(), args)
    print(f"kvloop: {show_sampling(params, args, llm.default_sampling)}", file=sys.stderr)
    printer = _Printer(llm.get_tokenizer(), args.json, single=len(prompts) == 1,
                       logprobs=params.logprobs)
    try:
        if args.chat:
            convs = []
            for prompt in args.prompt:
                msgs = [{"role": "system", "content": args.system}] if args.system else []
                convs.append([*msgs, {"role": "user", "content": prompt}])
            llm.chat(convs, params, use_tqdm=False, on_output=printer)
        else:
            llm.generate(prompts, params, use_tqdm=False, on_output=printer)
    finally:
        llm.close()
    return 1 if printer.failed else 0


class _Printer:
    """Prints outputs as they come: the single prompt's text streamed, a batch's completions
    as each finishes; logprobs, the ``[length]`` note and errors after each completion."""

    def __init__(self, tokenizer: Any, as_json: bool, *, single: bool,
                 logprobs: int | None = None, out: IO[str] | None = None) -> None:
        self.tok = tokenizer
        self.as_json = as_json
        self.single = single
        self.logprobs = logprobs
        self.out = out
        self.failed = False
        self._streamed = False

    def __call__(self, index: int, output: Any) -> None:
        out = self.out or sys.stdout
        if self.single and not self.as_json:
            self._stream(output, out)
        if not output.finished:
            return
        if self.as_json:
            print(json.dumps(self._json(index, output)), file=out, flush=True)
        else:
            if not self.single:
                print(f"[{index}] {self._text(output)}", file=out)
            elif self._streamed or output.token_ids:
                print(file=out)
            if output.logprobs:
                for line in self._logprob_lines(output):
                    print(line, file=out)
            out.flush()
        where = "" if self.single else f" (prompt {index})"
        if output.finish_reason == "length":
            print(f"kvloop: [length] the reply{where} stopped at {output.num_output_tokens} "
                  "tokens (max_tokens); raise --max-tokens for more", file=sys.stderr)
        if output.error:
            self.failed = True
            print(f"kvloop: error{where}: {output.error}", file=sys.stderr)

    def _stream(self, output: Any, out: IO[str]) -> None:
        if self.tok is None:
            piece = " ".join(map(str, output.new_token_ids))
            if piece and self._streamed:
                piece = " " + piece
        else:
            piece = output.new_text
        if piece:
            out.write(piece)
            out.flush()
            self._streamed = True

    def _text(self, output: Any) -> str:
        if self.tok is None:
            return " ".join(map(str, output.token_ids or []))
        return output.text or ""

    def _token(self, token_id: int) -> str:
        if self.tok is None:
            return str(token_id)
        return self.tok.decode([token_id], skip_special_tokens=False)

    def _json(self, index: int, output: Any) -> dict[str, Any]:
        m = output.metrics
        data: dict[str, Any] = {
            "index": index,
            "text": output.text,
            "token_ids": output.token_ids,
            "finish_reason": output.finish_reason,
            "ttft_s": m.ttft if m else None,
            "tpot_s": m.tpot if m else None,
            "e2e_s": m.e2e if m else None,
        }
        if output.logprobs is not None:
            data["logprobs"] = [
                {"token_id": tid, "token": self._token(tid), "logprob": lp,
                 "top_logprobs": [{"token_id": t, "token": self._token(t), "logprob": v}
                                  for t, v in top]}
                for tid, lp, top in self._top(output)]
        if output.error:
            data["error"] = output.error
        return data

    def _top(self, output: Any) -> list[tuple[int, float, list[tuple[int, float]]]]:
        """Per output token: (sampled id, its logprob, the top N asked for, best first; the
        engine's dict holds those and the sampled token)."""
        k = self.logprobs or 0
        rows = []
        for token_id, lps in zip(output.token_ids or [], output.logprobs or [], strict=False):
            ranked = sorted(lps.items(), key=lambda kv: (-kv[1], kv[0]))
            rows.append((token_id, lps.get(token_id, float("nan")), ranked[:k]))
        return rows

    def _logprob_lines(self, output: Any) -> list[str]:
        lines = ["logprobs (token: logprob | top alternatives):"]
        for i, (tid, lp, top) in enumerate(self._top(output)):
            alts = ", ".join(f"{json.dumps(self._token(t), ensure_ascii=False)} {v:.3f}"
                             for t, v in top)
            token = json.dumps(self._token(tid), ensure_ascii=False)
            lines.append(f"{i:>4}  {token:<18} {lp:8.3f}  | {alts}")
        return lines
