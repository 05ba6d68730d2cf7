"""Admitting waiting requests: the waiting pass of ``Scheduler.schedule``.

Part of ``Scheduler`` (a mixin: the state is the scheduler's). Requests are popped in the
policy's order and admitted while the step has tokens, seats and KV blocks for them; a
policy may reject one it can no longer serve well; under cost-aware preemption admission
keeps growth headroom for the running requests (``_headroom``) and the blocks their
unfinished prompts still need (``_pending_prompt_blocks``), and counts a new prompt whole.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvloop.core.decisions import Cause, Reason
from kvloop.core.request import Request, RequestStatus
from kvloop.core.state import SchedulerState
from kvloop.core.step import StepBuilder

_RUNNING = RequestStatus.RUNNING
HEADROOM_TOKENS = 64
"""Tokens of KV growth per running request that cost-aware admission keeps free."""


class Admission(SchedulerState):
    """The waiting pass of ``Scheduler``."""

    def _schedule_waiting(self, b: StepBuilder) -> None:
        # NOTE: swapped requests come back before new work is admitted (no starvation), and
        # a step that had to preempt admits nothing new (that would only thrash).
        waiting = self.waiting
        if self.swapped or b.preempted or not len(waiting):
            if b.decisions is not None and len(waiting):
                b.decisions.stop(Reason.SWAPPED_FIRST if self.swapped else Reason.STEP_PREEMPTED,
                                 len(waiting))
            return
        d = b.decisions
        stop: Reason | None = None  # NOTE: set only while recording (``d``)
        cfg, kv = self.config, self.kv
        skipped: list[Request] = []
        reject = self.policy.reject
        # NOTE: cost-aware admission keeps free blocks for the running requests' next
        # HEADROOM_TOKENS tokens each (fewer if max_tokens ends them sooner): admitting into
        # the last free blocks only forces a preemption, and a recompute, a few steps
        # later.
        # NOTE: it starts as the bound HEADROOM_TOKENS per running request (O(1)) and is
        # summed exactly over the running requests only when that bound would hold a
        # request back, so a roomy pool pays nothing per running request.
        # NOTE: a prompt's later chunks are certain growth, not a guess: a request is
        # admitted only if its whole prompt fits beside the rest of the running prompts
        # (``pending``) and the headroom. Admitted on its first chunk alone, a long prompt
        # later takes the last free blocks and the next one to grow preempts it (or it
        # preempts the decodes), throwing away thousands of computed tokens.
        # tokens of growth kept free for the running requests (None: none kept)
        headroom = len(self.running) * HEADROOM_TOKENS if cfg.cost_aware_preemption else None
        exact = False
        pending: int | None = None  # blocks the running prompts still need (once counted)
        preempts = self.policy.preempts_running
        unforked = self._unforked
        reserved = sum(unforked.values()) if unforked else 0
        while (len(waiting) and b.budget > 0
               and len(self.running) + reserved < cfg.max_num_seqs):
            req = waiting.pop()
            if reject is not None and req.num_preemptions == 0:
                why = reject(req, b.start_time)
                if why is not None:
                    req.error = why
                    self._finish(req, RequestStatus.FINISHED_REJECTED)
                    continue
            if req.request_id in b.preempted_ids:  # do not readmit a victim in its own step
                skipped.append(req)
                if d is not None:
                    d.held.append((req.request_id, Reason.JUST_PREEMPTED))
                continue
            group = req.group if req.group is not None and not req.group.forked else None
            if group is not None and len(self.running) + reserved + group.n > cfg.max_num_seqs:
                waiting.add_front([req])  # NOTE: a group is admitted as one unit
                if d is not None:
                    d.held.append((req.request_id, Reason.SEATS))
                    stop = Reason.SEATS
                break
            hits = kv.get_computed_blocks(req)
            num_hit = len(hits) * kv.block_size
            remaining = req.num_tokens - num_hit
            if group is not None:
                # NOTE: the leader prefills all but the last prompt token (then forks).
                if hits and num_hit == req.num_prompt_tokens - 1:
                    hits = hits[:-1]
                    num_hit -= kv.block_size
                remaining = req.num_prompt_tokens - 1 - num_hit
                if remaining == 0:  # a one-token prompt: every sequence computes it now
                    if not self._admit_and_fork(req, b):
                        waiting.add_front([req])
                        if d is not None:
                            d.held.append((req.request_id, Reason.BLOCKS))
                            stop = Reason.BLOCKS
                        break
                    reserved = sum(unforked.values())
                    continue
            n = self._chunk(remaining, b.budget)
            if n < remaining:
                # NOTE: without chunking the budget covers max_model_len (config check).
                if not cfg.enable_chunked_prefill:
                    waiting.add_front([req])  # wait for a step with room for all of it
                    if d is not None:
                        d.held.append((req.request_id, Reason.WHOLE_PROMPT))
                        stop = Reason.WHOLE_PROMPT
                    break
                if self._num_partial(b) >= cfg.max_num_partial_prefills:
                    skipped.append(req)  # a shorter prompt behind it may still fit
                    if d is not None:
                        d.held.append((req.request_id, Reason.PARTIAL_PREFILLS))
                    continue
            if headroom:
                if pending is None:
                    pending = self._pending_prompt_blocks()
                whole = num_hit + remaining  # the prompt (a leader's: all but its last token)
                left = kv.num_free_blocks - (kv.blocks_needed(whole) - len(hits)) - pending
                if left < kv.blocks_needed(headroom) and not exact:
                    headroom, exact = _headroom(self.running), True
                if left < kv.blocks_needed(headroom) and (
                        not preempts or not any(r.priority > req.priority for r in self.running)):
                    # NOTE: keep the running requests' growth room, unless the request may
                    # preempt some of them for urgency anyway.
                    waiting.add_front([req])
                    if d is not None:
                        d.held.append((req.request_id, Reason.HEADROOM))
                        stop = Reason.HEADROOM
                    break
            req.num_computed_tokens = num_hit
            new_ids = kv.allocate_slots(req, n, hits)
            if new_ids is None and d is not None:
                d.cause = (Cause.PRIORITY, req.request_id)
            while new_ids is None and self.policy.preempts_running:
                victim = self._pick_victim(b, worse_than=req)
                if victim is None:
                    break
                self._preempt(victim, b)
                new_ids = kv.allocate_slots(req, n, hits)
            if new_ids is None:
                req.num_computed_tokens = 0
                waiting.add_front([req])
                if d is not None:
                    d.held.append((req.request_id, Reason.BLOCKS))
                    stop = Reason.BLOCKS
                break
            self._admit(req, n, num_hit, new_ids, b)
            if headroom is not None:
                headroom += _headroom((req,)) if exact else HEADROOM_TOKENS
                if pending is not None and n < remaining:  # the chunks it has yet to compute
                    whole, first = num_hit + remaining, num_hit + n
                    pending += kv.blocks_needed(whole) - kv.blocks_needed(first)
            if group is not None:
                reserved = sum(unforked.values())
        if skipped:
            waiting.add_front(skipped)
        if d is not None and len(waiting):
            if stop is None:  # NOTE: the loop's own conditions ended it
                stop = Reason.BUDGET if b.budget <= 0 else (
                    Reason.SEATS if len(self.running) + reserved >= cfg.max_num_seqs
                    else Reason.POLICY_ORDER)
            d.stop(stop, len(waiting))

    def _pending_prompt_blocks(self) -> int:
        """Blocks the running requests still need to finish their prompts (or recompute),
        beyond those they hold."""
        kv, requests, pending = self.kv, self.requests, 0
        for rid in self._prefilling:
            r = requests[rid]
            if r.num_computed_tokens < r.prefill_end:
                pending += max(0, kv.blocks_needed(r.num_tokens) - len(kv.block_ids(rid)))
        return pending

    def _admit(
        self, req: Request, n: int, num_hit: int, block_ids: list[int], b: StepBuilder
    ) -> None:
        """Decide to run ``req`` in this step (counted by ``_commit_admissions`` once the
        passes are done)."""
        req.status = _RUNNING
        self.running.append(req)
        self._prefilling.add(req.request_id)
        if req.group is not None and not req.group.forked:
            self._unforked[req.request_id] = req.group.n - 1
        b.charge(req, n, req.num_tokens - num_hit, block_ids)
        b.admitted[req.request_id] = num_hit

    def _commit_admissions(self, b: StepBuilder) -> None:
        """Count the admissions the step kept: prefix lookups (a first admission) or the
        tokens to recompute (a readmission), and first scheduled times.

        NOTE: after every pass, so an admission given back later in the same step
        (``_unadmit``) was never counted and has nothing to undo."""
        st, requests, start = self.stats, self.requests, b.start_time
        for rid, num_hit in b.admitted.items():
            req = requests[rid]
            if req.num_preemptions == 0:
                st.prefix_cache_queries += req.num_tokens
                st.prefix_cache_hits += num_hit
                b.prefix_queries += req.num_tokens
                b.prefix_hits += num_hit
            else:
                st.recompute_prefix_hits += num_hit
                recomputed = max(0, req.num_tokens - 1 - num_hit)
                req.num_recomputed_tokens += recomputed
                st.num_recomputed_tokens += recomputed
            if req.first_scheduled_time is None:
                req.first_scheduled_time = start
        for rid in b.forked:
            child = requests[rid]
            if child.first_scheduled_time is None:  # NOTE: forked in its leader's first step
                child.first_scheduled_time = start


def _headroom(running: Sequence[Request]) -> int:
    """Tokens the running requests may still add within ``HEADROOM_TOKENS`` each.

    NOTE: the only read of how far the running requests got in the waiting pass; fast-forward
    relies on that (``FastForward._progress_unread``)."""
    total = 0
    for r in running:
        left = r.sampling_params.max_tokens - len(r.output_token_ids)
        total += left if left < HEADROOM_TOKENS else HEADROOM_TOKENS
    return total
