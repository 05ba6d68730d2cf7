"""The decisions of the step being built, and its ``StepRecord`` once it ran.

``schedule()`` only records decisions here (tokens and new blocks per request, swaps,
preemptions); the ``SchedulerOutput`` is built from them after every pass ran, so undoing a
preempted request's share is a few dict pops.
"""

from __future__ import annotations

from typing import Any

from kvloop.core.decisions import Decisions
from kvloop.core.interface import ModelRunnerOutput, SchedulerOutput
from kvloop.core.request import Request
from kvloop.core.stats import ScheduledEntry, StepRecord

_NOTHING: list[Any] = []
"""The list of a record with nothing of that kind in its step.

NOTE: shared by many records, so a record's lists are never mutated (they are data)."""


class StepBuilder:
    """Mutable state of one ``schedule()`` call: budget left and what was decided."""

    __slots__ = (
        "admitted",
        "budget",
        "copies",
        "decisions",
        "discarded",
        "finished",
        "finishing_blocks",
        "forked",
        "new_blocks",
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
    )

    def __init__(self, token_budget: int, start_time: float) -> None:
        self.token_budget = token_budget
        self.budget = token_budget
        self.start_time = start_time
        self.scheduled: dict[str, int] = {}
        """Tokens to compute per request, in scheduling order."""
        self.new_blocks: dict[str, list[int]] = {}
        """Block ids added to a request's table this step (absent: none)."""
        self.admitted: dict[str, int] = {}
        """Requests admitted from the waiting queue this step -> tokens found cached."""
        self.forked: dict[str, int] = {}
        """Siblings forked from their group's leader this step -> tokens they share."""
        self.copies: list[tuple[int, int]] = []
        """(source, destination) device blocks copied for forked siblings."""
        self.swap_in: list[tuple[int, int]] = []
        self.swap_out: list[tuple[int, int]] = []
        self.swapped_in: list[str] = []
        self.discarded = 0
        """Computed tokens thrown away by recompute preemptions in this step."""
        self.finishing_blocks: int | None = None
        """Blocks that requests finishing by length in this step will free, less those
        promised to requests that wait for them (None: not counted yet)."""
        self.pinned: set[str] = set()
        """Swapped in or forked during this step: never a victim in the same step."""
        self.preempted: list[tuple[str, str]] = []
        self.preempted_ids: set[str] = set()
        self.prefill_kinds: dict[str, str] = {}
        """``prefill`` or ``recompute`` for each request computing prompt tokens; every
        other scheduled request decodes."""
        self.finished: list[tuple[str, str]] = []
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.decisions: Decisions | None = None
        """Reasons for what the step left out (only while a recorder records)."""

    def charge(self, req: Request, n: int, remaining: int, new_ids: list[int]) -> None:
        """Schedule ``n`` of the request's ``remaining`` tokens with ``new_ids`` as the
        blocks added to its table: the one place a request's share of a step is recorded
        (``charge_decodes`` is the same for many decodes at once)."""
        rid = req.request_id
        self.scheduled[rid] = n
        self.budget -= n
        if new_ids:
            self.new_blocks[rid] = new_ids
        if remaining > 1 or not req.output_token_ids:
            self.prefill_kinds[rid] = "recompute" if req.output_token_ids else "prefill"

    def charge_decodes(self, reqs: list[Request], new_blocks: dict[str, list[int]]) -> None:
        """``charge(req, 1, 1, new_blocks.get(id, []))`` for each of ``reqs`` (all decoding,
        none scheduled yet), at once."""
        self.scheduled.update(dict.fromkeys([r.request_id for r in reqs], 1))
        self.new_blocks.update(new_blocks)
        self.budget -= len(reqs)

    def uncharge(self, rid: str) -> None:
        """Undo ``charge`` for a request preempted later in the same step."""
        n = self.scheduled.pop(rid, None)
        if n is not None:
            self.budget += n
        self.new_blocks.pop(rid, None)
        self.prefill_kinds.pop(rid, None)
        self.admitted.pop(rid, None)


def build_step_record(
    b: StepBuilder,
    out: SchedulerOutput,
    runner: ModelRunnerOutput,
    end_time: float,
    arrived: list[tuple[str, float, int]],
    sampled: list[str],
    counts: tuple[int, int, int, int, int],
    arrived_info: dict[str, dict[str, Any]] | None = None,
    kv_extra: tuple[int, int, int, int] = (0, 0, 0, 0),
) -> StepRecord:
    """Describe a finished step. Called after progress was applied; ``counts`` is (KV blocks
    used, KV blocks in all, running, waiting, swapped) after the step; ``kv_extra`` is
    (block size, prefix-cached blocks, host blocks used, host blocks in all)."""
    c = out.cached_requests
    computed = dict(zip(c.request_ids, c.num_computed_tokens, strict=True))
    computed.update((d.request_id, d.num_computed_tokens) for d in out.new_requests)
    kinds = b.prefill_kinds
    entries = [
        ScheduledEntry(rid, n, kinds.get(rid, "decode"), computed[rid])
        for rid, n in out.num_scheduled_tokens.items()
    ]
    used, total, running, waiting, swapped = counts
    d = b.decisions
    block_size, cached, host_used, host_total = kv_extra
    admitted = held = left_out = causes = _NOTHING
    reason, behind, allocated, freed = None, 0, 0, 0
    if b.admitted:
        admitted = [[rid, b.scheduled.get(rid, 0), hit] for rid, hit in b.admitted.items()]
    if d is not None:
        if d.held:
            held = [list(h) for h in d.held]
        if d.left_out:
            left_out = [list(x) for x in d.left_out]
        if d.preempt_causes:
            causes = [list(x) for x in d.preempt_causes]
        reason, behind = d.stop_reason, d.num_behind
        if b.new_blocks and block_size:
            # NOTE: admitted requests' new blocks include their prefix hits (not taken from
            # the free pool); a swapped-in request's are its whole table, all fresh.
            allocated = (sum(map(len, b.new_blocks.values()))
                         - sum(b.admitted.values()) // block_size)
        freed = max(0, d.used_before + allocated - used)
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
        kv_blocks_used=used,
        num_gpu_blocks=total,
        prefix_cache_queries=b.prefix_queries,
        prefix_cache_hits=b.prefix_hits,
        num_running=running,
        num_waiting=waiting,
        num_swapped=swapped,
        arrived_info=arrived_info or {},
        admitted=admitted,
        held=held,
        held_reason=reason,
        num_held_behind=behind,
        left_out=left_out,
        preempt_causes=causes,
        kv_blocks_allocated=allocated,
        kv_blocks_freed=freed,
        kv_cached_blocks=cached,
        host_blocks_used=host_used,
        num_host_blocks=host_total,
        num_blocks_loaded=len(out.blocks_to_load),
        num_blocks_offloaded=len(out.blocks_to_offload),
        kv_load_choices=out.kv_load_choices,
        block_size=block_size,
    )
