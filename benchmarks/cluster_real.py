"""Replicas on this machine: ``kvloop serve`` with 1 and 2 replicas of the default model on
Ray Serve (one torch thread each), driven to saturation by ``kvloop bench serve``.

Also run, as references, the single engine without Ray (no ingress hop) with 1 and with 2
threads: what a second replica buys on the same cores against what a second thread buys.
One configuration after the other in one run, so their ratios are the result (this
machine's absolute speed drifts). Run directly or as ``benchmarks/cluster.py --part real``.

    python benchmarks/cluster_real.py [--num-prompts 64] [--concurrency 32]
        [--input-len 128] [--output-len 64] [--json PATH] [--docs docs/cluster.md]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvloop.bench import ServeBenchConfig, run_bench

sys.path.insert(0, str(Path(__file__).parent))
from policies_engine import cpu_name, free_port, serve_default

CONFIGS: dict[str, tuple[list[str], dict[str, str]]] = {
    "1 engine, no Ray, 1 thread": ([], {"OMP_NUM_THREADS": "1"}),
    "1 engine, no Ray, 2 threads": ([], {"OMP_NUM_THREADS": "2"}),
    "1 replica on Ray, 1 thread": (["--replicas", "1", "--threads-per-replica", "1"], {}),
    "2 replicas on Ray, 1 thread each": (["--replicas", "2", "--threads-per-replica", "1"],
                                         {}),
}
"""Label -> ``kvloop serve`` flags and environment."""
BEGIN, END = "<!-- real:begin -->", "<!-- real:end -->"


def run_one(label: str, args: argparse.Namespace) -> dict[str, Any]:
    flags, env = CONFIGS[label]
    port = free_port()
    with serve_default(flags, port, env):
        cfg = ServeBenchConfig(
            base_url=f"http://127.0.0.1:{port}", num_prompts=args.num_prompts,
            max_concurrency=args.concurrency, random_input_len=args.input_len,
            random_output_len=args.output_len, ignore_eos=True, seed=args.seed,
            progress=False)
        report = run_bench(cfg)
    s = report["summary"]
    return {"config": label, "completed": s["completed"], "errors": report["errors"],
            "output_throughput": s["output_throughput"],
            "ttft_p50": s["ttft"]["p50"], "ttft_p99": s["ttft"]["p99"],
            "tpot_p50": s["tpot"]["p50"]}


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table, throughput relative to one replica on Ray."""
    base = next((r["output_throughput"] for r in rows
                 if r["config"].startswith("1 replica")), None)
    lines = ["| configuration | done | output tok/s | vs 1 replica | TTFT p50 / p99 s | "
             "TPOT p50 ms |", "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['output_throughput'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['config']} | {r['completed']} | {r['output_throughput']:.1f} | "
                     f"{ratio} | {r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | "
                     f"{r['tpot_p50'] * 1000:.0f} |")
    return "\n".join(lines)


def write_docs(path: Path, text: str) -> None:
    """Replace the text between the ``real`` markers of ``path`` (append them if absent)."""
    doc = path.read_text() if path.exists() else ""
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in doc and END in doc:
        doc = doc[:doc.index(BEGIN)] + block + doc[doc.index(END) + len(END):]
    else:
        doc = doc.rstrip() + "\n\n" + block + "\n"
    path.write_text(doc)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32,
                   help="requests in flight (saturation) (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--docs", default=None, help="write the table into this markdown file")


def real(args: argparse.Namespace) -> int:
    """Run every configuration, print the table, optionally write JSON and docs."""
    cpu = cpu_name()
    head = (f"Measured on {cpu}: {args.num_prompts} requests of {args.input_len} prompt "
            f"tokens (random ids) and {args.output_len} forced output tokens, "
            f"{args.concurrency} in flight, default model (fp32).")
    print(f"# {head}", flush=True)
    rows = []
    for label in CONFIGS:
        started = time.perf_counter()
        rows.append(run_one(label, args))
        print(f"  {label}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    text = table(rows)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu, "args": vars(args), "rows": rows},
                                              indent=1))
    if args.docs:
        write_docs(Path(args.docs), f"{head}\n\n{text}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    add_args(p)
    return real(p.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
