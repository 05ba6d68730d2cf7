"""Bookkeeping of the step being built, and its ``StepRecord`` once it ran."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvloop.core.interface import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from kvloop.core.request import Request
from kvloop.core.stats import ScheduledEntry, StepRecord

if TYPE_CHECKING:
    from kvloop.core.scheduler import Scheduler


class StepBuilder:
    """Mutable state of one ``schedule()`` call: budget left and what was decided."""

    __slots__ = (
        "admitted",
        "budget",
        "cached",
        "finished",
        "new_requests",
        "num_partial",
        "pinned",
        "preempted",
        "preempted_ids",
        "prefill_kinds",
        "prefix_hits",
        "prefix_queries",
        "scheduled",
        "start_time",
        "swap_in",
        "swap_out",
        "swapped_in",
        "token_budget",
        "total_tokens",
    )

    def __init__(self, token_budget: int, start_time: float) -> None:
        self.token_budget = token_budget
        self.budget = token_budget
        self.start_time = start_time
        self.total_tokens = 0
        self.scheduled: dict[str, int] = {}
        self.new_requests: list[NewRequestData] = []
        self.cached = CachedRequestData()
        self.swap_in: list[tuple[int, int]] = []
        self.swap_out: list[tuple[int, int]] = []
        self.swapped_in: list[str] = []
        self.preempted: list[tuple[str, str]] = []
        self.preempted_ids: set[str] = set()
        self.pinned: set[str] = set()
        """Swapped in during this step: never a victim in the same step."""
        self.admitted: set[str] = set()
        """Admitted from the waiting queue during this step."""
        self.prefill_kinds: dict[str, str] = {}
        """``prefill`` or ``recompute`` for each request computing prompt tokens; every
        other scheduled request decodes."""
        self.num_partial = 0
        """Requests whose prefill stays unfinished after this step."""
        self.finished: list[tuple[str, str]] = []
        self.prefix_queries = 0
        self.prefix_hits = 0

    def mark_prefill(self, request: Request) -> None:
        self.prefill_kinds[request.request_id] = (
            "recompute" if request.output_token_ids else "prefill"
        )

    def unschedule(self, request_id: str) -> None:
        """Drop a request's entry from the step's new or cached request data."""
        for i, data in enumerate(self.new_requests):
            if data.request_id == request_id:
                del self.new_requests[i]
                return
        c = self.cached
        if request_id in c.request_ids:
            i = c.request_ids.index(request_id)
            del c.request_ids[i], c.new_block_ids[i], c.num_computed_tokens[i]
            del c.resumed_from_swap[i]
        self.prefill_kinds.pop(request_id, None)


def build_step_record(
    scheduler: Scheduler,
    b: StepBuilder,
    out: SchedulerOutput,
    runner: ModelRunnerOutput,
    end_time: float,
    arrived: list[tuple[str, float, int]],
    sampled: list[str],
) -> StepRecord:
    """Describe a finished step. Called after progress was applied."""
    c = out.cached_requests
    computed = dict(zip(c.request_ids, c.num_computed_tokens, strict=True))
    computed.update((d.request_id, d.num_computed_tokens) for d in out.new_requests)
    kinds = b.prefill_kinds
    entries = [
        ScheduledEntry(rid, n, kinds.get(rid, "decode"), computed[rid])
        for rid, n in out.num_scheduled_tokens.items()
    ]
    kv = scheduler.kv
    return StepRecord(
        step=out.step,
        time_s=b.start_time,
        step_time_s=runner.step_time_s,
        end_time_s=end_time,
        scheduled=entries,
        num_batched_tokens=out.total_num_scheduled_tokens,
        token_budget=b.token_budget,
        preempted=b.preempted,
        num_blocks_swapped_out=len(out.blocks_to_swap_out),
        num_blocks_swapped_in=len(out.blocks_to_swap_in),
        swapped_in=b.swapped_in,
        finished=b.finished,
        arrived=arrived,
        sampled=sampled,
        kv_blocks_used=kv.num_used_blocks,
        num_gpu_blocks=kv.num_gpu_blocks,
        prefix_cache_queries=b.prefix_queries,
        prefix_cache_hits=b.prefix_hits,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_swapped=len(scheduler.swapped),
    )
