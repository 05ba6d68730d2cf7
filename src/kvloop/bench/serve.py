"""``kvloop bench serve``'s engine: build a workload, drive an endpoint, summarise.

Arrivals and lengths come from ``kvloop.sim`` (Poisson/gamma arrivals, ShareGPT lengths,
shipped trace replay), prompts from :mod:`kvloop.bench.prompts`, requests from
:mod:`kvloop.bench.client`, and the metrics from :func:`kvloop.sim.metrics.summarize_requests`,
so TTFT, TPOT, ITL, e2e, throughput and goodput mean what ARCHITECTURE.md says. A client
cannot see queueing, so there is no queue-time metric; a request's arrival is when it was
sent (after waiting for a ``max_concurrency`` slot, as in vLLM's benchmark).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from kvloop.bench.client import RequestRecord, fetch_models, normalize_base_url, send
from kvloop.bench.progress import BenchProgress
from kvloop.bench.prompts import PromptBuilder, load_tokenizer
from kvloop.sim.metrics import format_table, summarize_requests
from kvloop.sim.traces import WorkloadRequest, load_trace
from kvloop.sim.workloads import apply_tenant_mix, parse_tenant_mix, synthetic_workload

__all__ = ["ServeBenchConfig", "build_workload", "format_report", "run_bench", "run_bench_async"]

DATASETS = ("random", "sharegpt")
TRACES = ("azure-conv", "azure-code", "mooncake")
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class ServeBenchConfig:
    """Everything one benchmark run needs; the CLI flags map one to one."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    """Served model name; None: the first of ``GET /v1/models``."""
    endpoint: str = "completions"
    api_key: str | None = None
    num_prompts: int = 20
    request_rate: float = math.inf
    """Requests per second (Poisson, or gamma with ``burstiness``); inf: all at once."""
    burstiness: float = 1.0
    max_concurrency: int | None = None
    """Cap on requests in flight (closed loop when the rate is inf)."""
    trace: str | None = None
    """Replay a shipped trace's arrivals and lengths instead of a dataset."""
    rate_scale: float = 1.0
    dataset: str = "random"
    random_input_len: int = 128
    random_output_len: int = 64
    random_range_ratio: float = 0.0
    """Random lengths are uniform in [len * (1 - r), len * (1 + r)]."""
    max_input_len: int | None = None
    """Clip prompt lengths (traces and ShareGPT can exceed a small model's context)."""
    max_output_len: int | None = None
    seed: int = 0
    ignore_eos: bool = False
    extra_fields: bool = True
    """Send non-OpenAI fields (``ignore_eos``); off for servers that reject them."""
    min_tokens: bool = False
    """Send ``min_tokens`` = the output length (vLLM, llama-cpp-python): forces output
    lengths on servers that ignore ``ignore_eos``."""
    temperature: float = 0.0
    tokenizer: str | None = None
    tokenizer_model: str = "default"
    tenant_mix: str | None = None
    """Shares of tenants ``t0, t1, ...`` (``"0.6,0.05,..."``): each request names its tenant
    in the OpenAI ``user`` field, and the report gains per-tenant rows and Jain's index."""
    goodput: dict[str, float] = field(default_factory=dict)
    """SLOs in seconds by metric name: ``ttft``, ``tpot``."""
    timeout: float = 600.0
    """Seconds one request may take."""
    progress: bool = True

    def check(self) -> None:
        """Raise ValueError naming the first bad setting."""
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}")
        if self.dataset not in DATASETS:
            raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}")
        if self.trace is not None and self.trace not in TRACES:
            raise ValueError(f"--trace must be one of {', '.join(TRACES)}")
        if self.num_prompts < 1:
            raise ValueError("--num-prompts must be >= 1")
        if not self.request_rate > 0:
            raise ValueError("--request-rate must be > 0 (inf: all at once)")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError("--burstiness must be a positive number")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")
        if not (self.rate_scale > 0 and math.isfinite(self.rate_scale)):
            raise ValueError("--rate-scale must be a positive number")
        if min(self.random_input_len, self.random_output_len) < 1:
            raise ValueError("--random-input-len and --random-output-len must be >= 1")
        if not 0 <= self.random_range_ratio < 1:
            raise ValueError("--random-range-ratio must be in [0, 1)")
        for name in ("max_input_len", "max_output_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.tenant_mix is not None:
            parse_tenant_mix(self.tenant_mix)  # NOTE: raises ValueError naming the mix
        unknown = set(self.goodput) - {"ttft", "tpot"}
        if unknown:
            raise ValueError(f"--goodput takes ttft:MS and tpot:MS, not {sorted(unknown)}")
        normalize_base_url(self.base_url)


def _spec(length: int, ratio: float) -> str:
    low, high = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return str(low) if low == high else f"{low}:{high}"


def build_workload(cfg: ServeBenchConfig) -> list[WorkloadRequest]:
    """The requests to send, sorted by arrival, with lengths clipped to the caps."""
    if cfg.trace is not None:
        rate = None if math.isinf(cfg.request_rate) else cfg.request_rate
        reqs = load_trace(cfg.trace, rate_scale=cfg.rate_scale, num_requests=cfg.num_prompts,
                          request_rate=rate, seed=cfg.seed)
    else:
        if cfg.dataset == "sharegpt":
            plen, olen = "trace:sharegpt", "trace:sharegpt"
        else:
            plen = _spec(cfg.random_input_len, cfg.random_range_ratio)
            olen = _spec(cfg.random_output_len, cfg.random_range_ratio)
        reqs = synthetic_workload(cfg.num_prompts, request_rate=cfg.request_rate,
                                  burstiness=cfg.burstiness, prompt_len=plen, output_len=olen,
                                  seed=cfg.seed)
    for req in reqs:
        if cfg.max_input_len is not None and len(req.prompt_token_ids) > cfg.max_input_len:
            req.prompt_token_ids = req.prompt_token_ids[: cfg.max_input_len]
        if cfg.max_output_len is not None:
            req.output_len = min(req.output_len, cfg.max_output_len)
    if cfg.tenant_mix is not None:
        apply_tenant_mix(reqs, parse_tenant_mix(cfg.tenant_mix), seed=cfg.seed)
    return reqs


def _payload(
    cfg: ServeBenchConfig, model: str, text: str, output_len: int, tenant: str = ""
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model}
    if tenant:
        body["user"] = tenant
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    body.update(max_tokens=output_len, temperature=cfg.temperature, stream=True,
                stream_options={"include_usage": True})
    if cfg.ignore_eos and cfg.extra_fields:
        body["ignore_eos"] = True
    if cfg.min_tokens:
        body["min_tokens"] = output_len
    return body


async def run_bench_async(cfg: ServeBenchConfig, tokenizer: Any = None) -> dict[str, Any]:
    """Run the benchmark; the report dict (see :func:`run_bench`)."""
    import httpx

    cfg.check()
    base = normalize_base_url(cfg.base_url)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    workload = build_workload(cfg)
    slots = cfg.max_concurrency or len(workload)
    limits = httpx.Limits(max_connections=slots, max_keepalive_connections=slots)
    timeout = httpx.Timeout(cfg.timeout, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        models = await fetch_models(client, base, headers)
        model = cfg.model or (models[0] if models else None)
        if model is None:
            raise RuntimeError(f"{base}/v1/models lists no model: give --model")
        # NOTE: prompts are built before the clock starts; tokenizing costs no request time.
        tok = tokenizer or load_tokenizer(cfg.tokenizer, cfg.tokenizer_model)
        builder = PromptBuilder(tok, cfg.seed)
        texts = [builder.text_for(r.prompt_token_ids) for r in workload]
        records = [RequestRecord(r.request_id, r.arrival_time, builder.count(t), r.output_len,
                                 tenant=r.tenant)
                   for r, t in zip(workload, texts, strict=True)]
        url = base + ENDPOINTS[cfg.endpoint]
        sem = asyncio.Semaphore(slots)
        bar = BenchProgress(len(records), sum(r.output_len for r in workload),
                            enabled=cfg.progress)

        async def one(i: int) -> None:
            record = records[i]
            async with sem:
                body = _payload(cfg, model, texts[i], workload[i].output_len, workload[i].tenant)
                bar.on_sent()
                await send(client, url, body, headers, record, start, bar.on_token)
            failed = record.status == "FINISHED_ERROR"
            streamed = len(record.token_times)
            bar.on_finished(workload[i].output_len, streamed,
                            streamed if failed else record.num_output_tokens, failed)

        start = time.perf_counter()
        tasks = []
        for i, req in enumerate(workload):
            delay = req.arrival_time - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        bar.close()
    return _report(cfg, model, records)


def run_bench(cfg: ServeBenchConfig, tokenizer: Any = None) -> dict[str, Any]:
    """Run the benchmark and return its report: ``config``, ``model``, ``summary``
    (``summarize_requests``'s dict, seconds), ``errors`` (message -> count) and ``requests``
    (one row per request: arrival offset, ttft, tpot, itl list, e2e, token counts, error)."""
    return asyncio.run(run_bench_async(cfg, tokenizer))


def _report(cfg: ServeBenchConfig, model: str, records: list[RequestRecord]) -> dict[str, Any]:
    summary = summarize_requests(records, slo_ttft=cfg.goodput.get("ttft"),
                                 slo_tpot=cfg.goodput.get("tpot"))
    del summary["queue"], summary["preemptions"], summary["recomputed_tokens"]
    errors = Counter(r.error for r in records if r.error is not None)
    config = asdict(cfg)
    config["request_rate"] = str(cfg.request_rate) if math.isinf(cfg.request_rate) else (
        cfg.request_rate)
    return {"config": config, "model": model, "summary": summary,
            "errors": dict(errors.most_common()), "requests": [r.row() for r in records]}


def format_report(report: dict[str, Any], max_errors: int = 5) -> str:
    """The terminal table (latencies in ms), then the commonest errors with their counts."""
    lines = [format_table(report["summary"])]
    errors = report["errors"]
    if errors:
        total = sum(errors.values())
        lines.append(f"{total} failed request(s); errors:")
        for message, count in list(errors.items())[:max_errors]:
            lines.append(f"  {count} x {message}")
        if len(errors) > max_errors:
            lines.append(f"  ... and {len(errors) - max_errors} other error message(s)")
    return "\n".join(lines)
