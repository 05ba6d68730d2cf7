"""Prometheus metrics named like vLLM's, with a ``kvloop:`` prefix (dashboards port by a rename).

Everything is fed from the engine thread: gauges and counters from the engine's
``EngineStats`` snapshot after every step and every batch of commands, token counters and
``inter_token_latency_seconds`` from each step's outputs, the per-request histograms from
``RequestOutput.metrics`` when a request finishes, and ``iteration_tokens_total`` from the
growth of the scheduler's token totals between snapshots. Every series
carries a ``model_name`` label, as vLLM's do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvloop.engine.outputs import RequestOutput
from kvloop.engine.stats import EngineStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_SUCCESS_REASONS = frozenset({"stop", "length", "abort", "rejected"})
"""Finish reasons counted by ``request_success`` (vLLM's: every finish but an error; kvloop
adds ``rejected``, the scheduling policy's refusal); an error counts in
``num_requests_failed``."""


HOST_TIER_COUNTERS = {
    "host_hit_blocks": "Prefix blocks found in the host tier and loaded back.",
    "blocks_loaded": "KV blocks copied host -> device for prefix hits.",
    "blocks_stored": "KV blocks copied device -> host into the prefix cache's host tier.",
    "host_evictions": "Host-tier blocks dropped for room (its LRU, or reclaimed by swap).",
    "bytes_loaded": "Bytes copied host -> device for prefix hits.",
    "bytes_stored": "Bytes copied device -> host into the host tier.",
}
"""The prefix cache's host-tier counters (``kvloop:kv_offload_<name>``), present only when
the engine has a host tier."""


@dataclass
class Totals:
    """Plain running totals and the latest state, for the periodic log line."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    recomputed_tokens: int = 0
    running: int = 0
    waiting: int = 0
    swapped: int = 0
    kv_usage: float = 0.0


class ServerMetrics:
    """The server's Prometheus registry (one per app, so several servers can share a process)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self.totals = Totals()
        self._last_token_time: dict[str, float] = {}
        self._step_tokens = 0
        r, lab = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"kvloop:{name}", doc, lab, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(f"kvloop:{name}", doc, lab, registry=r).labels(model_name)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(f"kvloop:{name}", doc, lab, buckets=buckets,
                             registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests running on the device.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.swapped = gauge("num_requests_swapped", "Requests swapped out to the CPU tier.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV cache usage (1 means 100 percent).")
        self.preemptions = counter("num_preemptions", "Cumulative preemptions.")
        self.recomputed_tokens = counter("recomputed_tokens", "Tokens computed again after "
                                         "recompute preemptions (the recompute spikes).")
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens of requests (at their "
                                     "first output token).")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the "
                                      "prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix "
                                   "cache.")
        self._success = Counter("kvloop:request_success", "Finished requests by reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.failed = counter("num_requests_failed", "Requests that finished with an error.")
        self.host_tier = {
            name: counter(f"kv_offload_{name}", doc) for name, doc in HOST_TIER_COUNTERS.items()}
        self._host_tier_seen = dict.fromkeys(HOST_TIER_COUNTERS, 0)
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.",
                         _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Gap between consecutive output tokens.",
                        _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token.", _REQUEST_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Arrival to first scheduled.",
                               _REQUEST_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds", "First scheduled to first "
                                 "token.", _REQUEST_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds", "First to last token.",
                                _REQUEST_BUCKETS)
        self.iteration_tokens = hist("iteration_tokens_total", "Tokens computed per step.",
                                     _TOKEN_BUCKETS)

    def render(self) -> bytes:
        """The exposition text of ``/metrics``."""
        return generate_latest(self.registry)

    # -- fed by the engine thread --------------------------------------------------------
    def observe_output(self, out: RequestOutput, now: float) -> None:
        """One request's progress in a step (or its abort)."""
        rid = out.request_id
        n = len(out.new_token_ids)
        if n:
            last = self._last_token_time.get(rid)
            if last is None:
                num_prompt = out.num_prompt_tokens
                self.prompt_tokens.inc(num_prompt)
                self.totals.prompt_tokens += num_prompt
            else:
                self.itl.observe(now - last)
            self._last_token_time[rid] = now
            self.generation_tokens.inc(n)
            self.totals.generation_tokens += n
        if out.finished:
            self._last_token_time.pop(rid, None)
            self._finished(out)

    def _finished(self, out: RequestOutput) -> None:
        reason = out.finish_reason or "unknown"
        if reason not in _SUCCESS_REASONS:
            self.failed.inc()
            return
        self._success.labels(self.model_name, reason).inc()
        m = out.metrics
        if m is None or reason in ("abort", "rejected"):  # NOTE: no latency of their own
            return
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.e2e is not None:
            self.e2e.observe(m.e2e)
            if m.ttft is not None:
                self.decode_time.observe(m.e2e - m.ttft)
        if m.queue_time is not None:
            self.queue_time.observe(m.queue_time)
        if m.first_token_time is not None and m.first_scheduled_time is not None:
            self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)

    def _observe_host_tier(self, stats: EngineStats) -> None:
        h, size = stats.host_tier, stats.kv_block_bytes
        assert h is not None
        now = {"host_hit_blocks": h.host_hit_blocks, "blocks_loaded": h.blocks_loaded,
               "blocks_stored": h.blocks_stored, "host_evictions": h.host_evictions,
               "bytes_loaded": h.blocks_loaded * size, "bytes_stored": h.blocks_stored * size}
        seen = self._host_tier_seen
        for name, value in now.items():
            if value > seen[name]:
                self.host_tier[name].inc(value - seen[name])
                seen[name] = value

    def observe_stats(self, stats: EngineStats) -> None:
        """The engine's snapshot after a step or a batch of commands: gauges, and the
        growth of its cumulative counters since the previous snapshot."""
        st, t = stats.scheduler, self.totals
        tokens = st.num_prompt_tokens + st.num_generation_tokens
        if tokens > self._step_tokens:
            self.iteration_tokens.observe(tokens - self._step_tokens)
            self._step_tokens = tokens
        if st.num_preemptions > t.num_preemptions:
            self.preemptions.inc(st.num_preemptions - t.num_preemptions)
            t.num_preemptions = st.num_preemptions
        if st.num_recomputed_tokens > t.recomputed_tokens:
            self.recomputed_tokens.inc(st.num_recomputed_tokens - t.recomputed_tokens)
            t.recomputed_tokens = st.num_recomputed_tokens
        if st.prefix_cache_queries > t.prefix_queries:
            self.prefix_queries.inc(st.prefix_cache_queries - t.prefix_queries)
            t.prefix_queries = st.prefix_cache_queries
        if st.prefix_cache_hits > t.prefix_hits:
            self.prefix_hits.inc(st.prefix_cache_hits - t.prefix_hits)
            t.prefix_hits = st.prefix_cache_hits
        if stats.host_tier is not None:
            self._observe_host_tier(stats)
        t.running, t.waiting = stats.num_running, stats.num_waiting
        t.swapped, t.kv_usage = stats.num_swapped, stats.kv_usage
        self.running.set(t.running)
        self.waiting.set(t.waiting)
        self.swapped.set(t.swapped)
        self.kv_usage.set(t.kv_usage)
