"""``/metrics`` parses with prometheus_client, carries vLLM's names with a ``kvloop:`` prefix,
and its counters and histograms move as requests finish."""

from __future__ import annotations

import asyncio
import logging

import httpx
from prometheus_client.parser import text_string_to_metric_families
from serverkit import MODEL_NAME, LiveServer

from kvloop.server.metrics import ServerMetrics
from kvloop.server.stats_logger import StatsLogger

NAMES = [
    "kvloop:num_requests_running",
    "kvloop:num_requests_waiting",
    "kvloop:num_requests_swapped",
    "kvloop:kv_cache_usage_perc",
    "kvloop:num_preemptions",
    "kvloop:recomputed_tokens",
    "kvloop:prompt_tokens",
    "kvloop:generation_tokens",
    "kvloop:request_success",
    "kvloop:prefix_cache_queries",
    "kvloop:prefix_cache_hits",
    "kvloop:time_to_first_token_seconds",
    "kvloop:inter_token_latency_seconds",
    "kvloop:e2e_request_latency_seconds",
    "kvloop:request_queue_time_seconds",
    "kvloop:request_prefill_time_seconds",
    "kvloop:request_decode_time_seconds",
    "kvloop:iteration_tokens_total",
]


def test_metrics_parse_and_have_vllm_names(server: LiveServer) -> None:
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert set(NAMES) <= set(families), set(NAMES) - set(families)
    for name in NAMES:
        for sample in families[name].samples:
            assert sample.labels.get("model_name") == MODEL_NAME


def test_counters_move_as_requests_finish(server: LiveServer) -> None:
    server.wait_idle()
    before = server.metrics()
    prompt = "prefix caching and chunked prefill " * 3  # > one block: a prefix-cache hit
    usage = []
    for _ in range(2):
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 5, "ignore_eos": True}
        r = httpx.post(f"{server.base_url}/completions", json=body, timeout=30)
        usage.append(r.json()["usage"])
    after = server.wait_idle()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("kvloop:request_success_total{length}") == 2
    assert delta("kvloop:generation_tokens_total") == 10
    assert delta("kvloop:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    assert delta("kvloop:prefix_cache_queries_total") == sum(u["prompt_tokens"] for u in usage)
    assert delta("kvloop:prefix_cache_hits_total") >= 16
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds"):
        assert delta(f"kvloop:{hist}_count") == 2, hist
    assert delta("kvloop:inter_token_latency_seconds_count") == 2 * 4
    assert delta("kvloop:iteration_tokens_total_count") >= 5
    assert delta("kvloop:iteration_tokens_total_sum") >= 10 + 16
    assert after["kvloop:num_requests_running"] == 0
    assert after["kvloop:kv_cache_usage_perc"] == 0


def test_stats_line(server: LiveServer) -> None:
    stats = StatsLogger(server.async_engine.metrics, interval=1.0)
    stats.line()
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
    httpx.post(f"{server.base_url}/completions", json=body, timeout=30)
    line = stats.line()
    assert line is not None
    for part in ("Avg prompt throughput", "Avg generation throughput", "Running: 0 reqs",
                 "Waiting: 0 reqs", "Swapped: 0 reqs", "KV cache usage: 0.0%",
                 "Prefix cache hit rate"):
        assert part in line, line
    assert stats.line() is None  # idle: nothing to say


def test_stats_logger_task_logs_periodically(caplog) -> None:
    metrics = ServerMetrics("m")
    stats = StatsLogger(metrics, interval=0.05)
    metrics.totals.generation_tokens = 40
    metrics.totals.running = 2

    async def run() -> None:
        task = asyncio.create_task(stats.run())
        await asyncio.sleep(0.12)
        task.cancel()

    with caplog.at_level(logging.INFO, logger="kvloop.server"):
        asyncio.run(run())
    lines = [r.message for r in caplog.records if "generation throughput" in r.message]
    assert len(lines) >= 1 and "Running: 2 reqs" in lines[0]


def test_preemption_counters_follow_the_scheduler() -> None:
    from kvloop.core.stats import SchedulerStats
    from kvloop.engine.stats import EngineStats

    m = ServerMetrics("m")
    for preempted, recomputed in ((0, 0), (2, 300), (3, 420)):
        st = SchedulerStats(num_preemptions=preempted, num_recomputed_tokens=recomputed)
        m.observe_stats(EngineStats(0, 0, 0, 0, 0.0, st))
    values = {s.name: s.value for f in text_string_to_metric_families(m.render().decode())
              for s in f.samples}
    assert values["kvloop:num_preemptions_total"] == 3
    assert values["kvloop:recomputed_tokens_total"] == 420
