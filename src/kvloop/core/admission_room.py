"""Cost-aware admission's room check: whether a waiting request may be admitted without
taking the blocks the running requests are about to need.

NOTE: cost-aware admission keeps free blocks for the running requests' next
``HEADROOM_TOKENS`` tokens each (fewer if ``max_tokens`` ends them sooner): admitting into
the last free blocks only forces a preemption, and a recompute, a few steps later. The room
starts as the bound ``HEADROOM_TOKENS`` per running request (O(1)) and is summed exactly
over the running requests only when that bound would hold a request back, so a roomy pool
pays nothing per running request.
NOTE: a prompt's later chunks are certain growth, not a guess: a request is admitted only
if its whole prompt fits beside the rest of the running prompts and the headroom. Admitted
on its first chunk alone, a long prompt later takes the last free blocks and the next one to
grow preempts it (or it preempts the decodes), throwing away thousands of computed tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvloop.core.request import Request

if TYPE_CHECKING:
    from kvloop.core.state import SchedulerState

HEADROOM_TOKENS = 64
"""Tokens of KV growth per running request that cost-aware admission keeps free."""


class AdmissionRoom:
    """The room one waiting pass keeps free (``cost_aware_preemption``): tokens of growth
    for the running requests (0 while nothing runs: nothing to keep) and the blocks their
    prompts still need."""

    def __init__(self, scheduler: SchedulerState) -> None:
        self._scheduler = scheduler
        self._kv = scheduler.kv
        self.headroom = len(scheduler.running) * HEADROOM_TOKENS
        """Tokens of growth kept free for the running requests."""
        self._exact = False
        self._pending: int | None = None
        """Blocks the running prompts still need (counted when first asked)."""

    def short(self, whole: int, num_hit_blocks: int) -> bool:
        """Whether a prompt of ``whole`` tokens (a group leader's: all but its last), of
        which ``num_hit_blocks`` blocks are cached, would leave less than the room free."""
        if not self.headroom:
            return False
        kv = self._kv
        if self._pending is None:
            self._pending = pending_prompt_blocks(self._scheduler)
        left = kv.num_free_blocks - (kv.blocks_needed(whole) - num_hit_blocks) - self._pending
        if left < kv.blocks_needed(self.headroom) and not self._exact:
            self.headroom, self._exact = _headroom(self._scheduler.running), True
        return left < kv.blocks_needed(self.headroom)

    def admitted(self, req: Request, first: int, whole: int) -> None:
        """Count ``req``, admitted with its first ``first`` tokens computed or scheduled, of
        ``whole`` before its decode: its growth, and its chunks yet to come."""
        self.headroom += _headroom((req,)) if self._exact else HEADROOM_TOKENS
        if self._pending is not None and first < whole:
            kv = self._kv
            self._pending += kv.blocks_needed(whole) - kv.blocks_needed(first)


def _headroom(running: Sequence[Request]) -> int:
    """Tokens the running requests may still add within ``HEADROOM_TOKENS`` each.

    NOTE: the only read of how far the running requests got in the waiting pass; fast-forward
    relies on that (``FastForward._progress_unread``)."""
    total = 0
    for r in running:
        left = r.sampling_params.max_tokens - len(r.output_token_ids)
        total += left if left < HEADROOM_TOKENS else HEADROOM_TOKENS
    return total


def pending_prompt_blocks(scheduler: SchedulerState) -> int:
    """Blocks the running requests still need to finish their prompts (or recompute),
    beyond those they hold."""
    kv, requests, pending = scheduler.kv, scheduler.requests, 0
    for rid in scheduler._prefilling:
        r = requests[rid]
        if r.num_computed_tokens < r.prefill_end:
            pending += max(0, kv.blocks_needed(r.num_tokens) - len(kv.block_ids(rid)))
    return pending
