"""``kvloop bench serve``: benchmark any OpenAI-compatible server with streaming requests.

Exit codes: 0 when at least one request succeeded, 1 when every request failed (the errors
are printed), 2 for bad flags or an unreachable server (one line, from ``kvloop.cli.main``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from kvloop.bench.serve import DATASETS, ENDPOINTS, TRACES, ServeBenchConfig


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks", description="kvloop's benchmarks.")
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    p = kinds.add_parser(
        "serve",
        help="benchmark an OpenAI-compatible server (kvloop, vLLM, llama.cpp, ...)",
        description="Send streaming requests to an OpenAI-compatible server and report TTFT, "
        "TPOT, ITL, e2e latency, throughput and goodput (like vLLM's benchmark_serving).",
    )
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server, with or without /v1 (default: %(default)s)")
    s.add_argument("--model", default=None,
                   help="served model name (default: the first of GET /v1/models)")
    s.add_argument("--endpoint", choices=list(ENDPOINTS), default="completions",
                   help="completions: /v1/completions; chat: /v1/chat/completions "
                   "(default: %(default)s)")
    s.add_argument("--api-key", default=None, help="sent as a Bearer token (default: none)")
    s.add_argument("--no-extra-fields", action="store_true",
                   help="send only OpenAI's fields (no ignore_eos) to servers rejecting others")
    s.add_argument("--timeout", type=float, default=600.0,
                   help="seconds per request (default: %(default)g)")
    w = p.add_argument_group("load")
    w.add_argument("--num-prompts", type=int, default=20,
                   help="requests to send (default: %(default)s: about 20 s against the "
                   "default model on a 2-core CPU; a GPU server wants hundreds)")
    w.add_argument("--request-rate", type=float, default=math.inf,
                   help="req/s, Poisson or gamma arrivals (default: inf, all at once)")
    w.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps; 1 = Poisson, lower = burstier "
                   "(default: %(default)g)")
    w.add_argument("--max-concurrency", type=int, default=None,
                   help="cap on requests in flight (default: none; with the default rate, "
                   "a closed loop)")
    w.add_argument("--trace", choices=TRACES, default=None,
                   help="replay a shipped trace's arrivals and lengths instead of --dataset "
                   "(default: none, --dataset)")
    w.add_argument("--rate-scale", type=float, default=1.0,
                   help="multiply the trace's arrival rate (default: %(default)g)")
    w.add_argument("--tenant-mix", default=None, metavar="SHARES",
                   help="tenants t0, t1, ... with these shares, e.g. 0.6,0.1,0.1,0.1,0.1: "
                   "sent as the OpenAI 'user' field; the report gains per-tenant rows "
                   "(default: none)")
    w.add_argument("--seed", type=int, default=0,
                   help="seed of arrivals, lengths and prompts (default: %(default)s). "
                   "The same seed sends the same prompts: a second run hits the server's "
                   "prefix cache and looks faster; use a different seed to compare runs fairly")
    d = p.add_argument_group("prompts")
    d.add_argument("--dataset", choices=DATASETS, default="random",
                   help="random lengths, or ShareGPT's prompt/output lengths (shipped) "
                   "(default: %(default)s)")
    d.add_argument("--random-input-len", type=int, default=128,
                   help="prompt tokens (default: %(default)s)")
    d.add_argument("--random-output-len", type=int, default=64,
                   help="output tokens asked for (max_tokens) (default: %(default)s)")
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in len * [1 - r, 1 + r] (default: %(default)g)")
    d.add_argument("--max-input-len", type=int, default=None,
                   help="clip prompt lengths (default: no clipping)")
    d.add_argument("--max-output-len", type=int, default=None,
                   help="clip output lengths (default: no clipping)")
    d.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos so that every request yields exactly its output length")
    d.add_argument("--min-tokens", action="store_true",
                   help="send min_tokens = output length (vLLM, llama-cpp-python), for servers "
                   "that ignore ignore_eos")
    d.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (default: %(default)g, greedy)")
    d.add_argument("--tokenizer", default=None,
                   help="tokenizer folder (or model) to build prompts with (default: that of "
                   "--tokenizer-model)")
    d.add_argument("--tokenizer-model", default="default",
                   help="model whose tokenizer builds prompts when --tokenizer is not given "
                   "(default: %(default)s, the embedded SmolLM2)")
    o = p.add_argument_group("output")
    o.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs in milliseconds (unlike the seconds of serve's "
                   "--slo-ttft/--slo-tpot), e.g. ttft:500 tpot:50 (default: none, no goodput)")
    o.add_argument("--json", default=None, metavar="PATH",
                   help="write the report with one row per request (default: none)")
    o.add_argument("--no-progress", action="store_true",
                   help="no progress line (it counts output tokens as they stream, with the "
                   "requests sent, running and done)")
    p.set_defaults(func=run)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` (ms) -> ``{"ttft": 0.5, "tpot": 0.05}`` (seconds)."""
    out: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not sep or not ms >= 0 or name not in ("ttft", "tpot"):
            raise ValueError(f"bad --goodput {item!r}: expected ttft:MS or tpot:MS")
        out[name] = ms / 1000.0
    return out


def config_from(args: argparse.Namespace) -> ServeBenchConfig:
    return ServeBenchConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint, api_key=args.api_key,
        num_prompts=args.num_prompts, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, trace=args.trace,
        rate_scale=args.rate_scale, dataset=args.dataset,
        random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio, max_input_len=args.max_input_len,
        max_output_len=args.max_output_len, seed=args.seed, ignore_eos=args.ignore_eos,
        extra_fields=not args.no_extra_fields, min_tokens=args.min_tokens,
        temperature=args.temperature,
        tokenizer=args.tokenizer, tokenizer_model=args.tokenizer_model,
        tenant_mix=args.tenant_mix, goodput=parse_goodput(args.goodput), timeout=args.timeout,
        progress=not args.no_progress,
    )


def run(args: argparse.Namespace) -> int:
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise RuntimeError("kvloop bench serve needs httpx: pip install httpx") from None
    from kvloop.bench.serve import format_report, run_bench

    cfg = config_from(args)
    cfg.check()
    report = run_bench(cfg)
    print(format_report(report))
    if args.json:
        path = Path(args.json)
        path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {path}", file=sys.stderr)
    return 0 if report["summary"]["completed"] else 1
