"""The periodic stats line, as vLLM logs it: throughput, queues, KV usage, prefix hit rate."""

from __future__ import annotations

import asyncio
import logging
import time

from kvloop.server.metrics import ServerMetrics, Totals

logger = logging.getLogger("kvloop.server")


class StatsLogger:
    """Logs one line every ``interval`` seconds while the server has anything to report."""

    def __init__(self, metrics: ServerMetrics, interval: float) -> None:
        self.metrics = metrics
        self.interval = interval
        self._last = (time.monotonic(), 0, 0)

    def line(self, now: float | None = None) -> str | None:
        """The line for the interval since the previous call; None when fully idle."""
        now = time.monotonic() if now is None else now
        t: Totals = self.metrics.totals
        then, prompt0, gen0 = self._last
        self._last = (now, t.prompt_tokens, t.generation_tokens)
        prompt, gen = t.prompt_tokens - prompt0, t.generation_tokens - gen0
        if not (prompt or gen or t.running or t.waiting or t.swapped):
            return None
        dt = max(now - then, 1e-9)
        hit = 100.0 * t.prefix_hits / t.prefix_queries if t.prefix_queries else 0.0
        return (
            f"Avg prompt throughput: {prompt / dt:.1f} tokens/s, "
            f"Avg generation throughput: {gen / dt:.1f} tokens/s, "
            f"Running: {t.running} reqs, Swapped: {t.swapped} reqs, Waiting: {t.waiting} reqs, "
            f"KV cache usage: {100.0 * t.kv_usage:.1f}%, Prefix cache hit rate: {hit:.1f}%"
        )

    async def run(self) -> None:
        """Log forever (cancel the task to stop)."""
        while True:
            await asyncio.sleep(self.interval)
            text = self.line()
            if text is not None:
                logger.info(text)
