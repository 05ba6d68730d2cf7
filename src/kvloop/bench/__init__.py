"""Serving benchmarks: ``kvloop bench serve`` drives any OpenAI-compatible server.

The public API is :func:`run_bench` over a :class:`ServeBenchConfig`; its report's
``summary`` uses :func:`kvloop.sim.metrics.summarize_requests`, so the metrics mean what
ARCHITECTURE.md says. Importing this package does not import httpx or transformers.
"""

from __future__ import annotations

from kvloop.bench.serve import ServeBenchConfig, format_report, run_bench, run_bench_async

__all__ = ["ServeBenchConfig", "format_report", "run_bench", "run_bench_async"]
