"""``EngineStats``: what the engine shows the outside of its state, as one immutable snapshot.

The engine takes it (``LLMEngine.stats()``) on the thread that steps it; the server hands it to
its event loop and its metrics, so nothing outside the engine reads scheduler or KV state.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvloop.core.host_tier import HostTierStats
from kvloop.core.stats import SchedulerStats


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's queues, KV usage and cumulative scheduler counters at one instant."""

    num_running: int
    """Requests running on the device."""
    num_waiting: int
    """Requests waiting to be scheduled (new or recompute-preempted)."""
    num_swapped: int
    """Requests swapped out to the host tier."""
    num_unfinished: int
    """Requests the engine holds, in any state."""
    kv_usage: float
    """Used fraction of the device KV blocks (1.0 means full)."""
    scheduler: SchedulerStats
    """A copy of the scheduler's cumulative counters (steps, tokens, preemptions, prefix
    cache queries and hits, finishes by reason)."""
    host_tier: HostTierStats | None = None
    """A copy of the prefix cache's host-tier counters (None: no host tier)."""
    kv_block_bytes: int = 0
    """Bytes of one KV block (0: unknown), to turn host-tier blocks into bytes."""

    @staticmethod
    def copy_counters(stats: SchedulerStats) -> SchedulerStats:
        """An independent copy of ``stats`` (its dicts included)."""
        return dataclasses.replace(stats, finished_by_reason=dict(stats.finished_by_reason))

