"""The loop's decisions: which requests compute how many tokens in the next step.

One token budget and one sequence cap per step are spent on running requests (a decode
takes 1 token, a partial prefill its next chunk), swapped-out requests coming back, and
waiting requests in policy order; ``prefill-first`` admits waiting requests first. A step
mixes prompt chunks and decodes: each request has ``num_computed_tokens`` and ``num_tokens``.

One step, top to bottom (this file, in this order; how a victim is chosen and taken off
the device, which the passes share, is ``kvloop.core.preemption``):

1. ``schedule`` opens the step (``StepBuilder``: the budget, capped by the policy's
   ``token_cap``) and runs the three passes in the configured order.
2. The running pass (``_schedule_running``): runs of decodes are charged in bulk (one slot
   each, a new block at a block boundary); a decode that finds no free block gets room
   made for it (``_make_room``: victims preempted, ``_preempt``, or under cost-aware rules
   the decode left out of this step instead, ``_wait_instead``) and its run goes on. A
   request with prompt work goes through ``_schedule_one``: its next chunk, with room made
   the same way, or its group's fork (``kvloop.core.group``, which preempts for room).
3. The swapped pass (``_schedule_swapped``): swapped-out requests come back in policy order
   while seats, budget and blocks allow, never in a step that preempted.
4. The waiting pass (``_schedule_waiting``): waiting requests in policy order, each with its
   prefix-cache hits, a chunk of its prompt, and room kept for the running requests'
   growth and unfinished prompts (cost-aware admission, ``kvloop.core.admission_room``);
   under the ``priority`` policy it may preempt running requests strictly less urgent.
   ``_admit`` records each admission, ``_hold`` puts back a request that must wait.
5. The decided step: ``_commit_admissions`` counts the admissions that stayed (prefix
   lookups, recomputed tokens, first scheduled times) and ``_build_output`` hands the
   executor what to run. ``update_from_output`` (``kvloop.core.results``) then applies the
   tokens.

The request's life outside the step (arrival, abort, a failed step, the invariants) is in
``kvloop.core.lifecycle``; preemption in ``kvloop.core.preemption``; forking groups in
``kvloop.core.group``; running many decode-only steps at once in
``kvloop.core.fast_forward``; the state they share in ``kvloop.core.state``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core.admission_room import AdmissionRoom
from kvloop.core.decisions import Cause, Decisions, Reason
from kvloop.core.fast_forward import FastForward
from kvloop.core.group import GroupForking
from kvloop.core.interface import CachedRequestData, NewRequestData, SchedulerOutput
from kvloop.core.kv_cache_manager import KVCacheManager
from kvloop.core.lifecycle import RequestLifecycle
from kvloop.core.policies import make_policy
from kvloop.core.preemption import Preemption
from kvloop.core.request import Request, RequestStatus
from kvloop.core.results import StepResults
from kvloop.core.stats import SchedulerStats, StepRecorder
from kvloop.core.step import StepBuilder

_RUNNING = RequestStatus.RUNNING


class Scheduler(RequestLifecycle, Preemption, StepResults, GroupForking, FastForward):
    """Continuous-batching scheduler over a paged KV cache."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        recorder: StepRecorder | None = None,
    ) -> None:
        self.config = scheduler_config
        self.cache_config = cache_config
        self.clock = clock
        self.recorder = recorder
        self.policy = make_policy(scheduler_config, clock)
        self.kv = KVCacheManager(cache_config)
        self.requests: dict[str, Request] = {}
        """Every unfinished request, by id."""
        self.waiting = self.policy.waiting
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.stats = SchedulerStats()
        self.step_index = 0
        # NOTE: without chunked prefill a prompt is never split, so no chunk cap applies.
        self._chunk_cap = (
            scheduler_config.prefill_chunk_cap if scheduler_config.enable_chunked_prefill else 0
        )
        self._finished_ids: list[str] = []
        self._num_added = 0
        self._arrived: list[tuple[str, float, int]] = []
        """Arrivals since the last step record (kept only when recording)."""
        self._arrived_info: dict[str, dict[str, object]] = {}
        """Tenant, priority and SLO targets of those arrivals that have any."""
        self._finished_log: list[tuple[str, str]] = []
        """Finishes not yet written to a step record (kept only when recording)."""
        self._step: StepBuilder | None = None
        self._prefilling: set[str] = set()
        """Running requests that may have prompt tokens left (see ``_num_partial``)."""
        self._unforked: dict[str, int] = {}
        """Running group leaders not forked yet -> the seats their siblings will take."""
        # NOTE: the one place the scheduling order is decided: the passes run in this order.
        passes = {"running": self._schedule_running, "swapped": self._schedule_swapped,
                  "waiting": self._schedule_waiting}
        order = (("running", "swapped", "waiting")
                 if scheduler_config.scheduling_order == "decode-first"
                 else ("waiting", "running", "swapped"))
        self._passes: tuple[Callable[[StepBuilder], None], ...] = tuple(
            passes[name] for name in order)

    # -- one step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide the next step. Must be followed by ``update_from_output``."""
        if self._step is not None:
            raise RuntimeError("schedule() called twice without update_from_output()")
        budget = self.config.max_num_batched_tokens
        token_cap = self.policy.token_cap
        if token_cap is not None:
            cap = token_cap(self.running)
            if cap is not None and cap < budget:
                budget = max(1, cap)
        b = self._step = StepBuilder(budget, self.clock())
        kv = self.kv
        if not kv.plain_lru:
            kv.begin_step()
            kv.protect(self.waiting)
        if self.recorder is not None:
            b.decisions = Decisions(self.kv.num_used_blocks)
        try:
            for schedule_pass in self._passes:
                schedule_pass(b)
            self._commit_admissions(b)
            return self._build_output(b)
        except BaseException as exc:
            # NOTE: blocks were allocated, swapped and freed as decided; none of it will
            # run, so the step is abandoned as a failed one is: its scheduled requests fail,
            # those it swapped out recompute, and the waiting pass put back what it held.
            self._step = None
            self._abandon(b, f"scheduler error: {exc!r}")
            raise

    # -- the running pass ----------------------------------------------------------

    def _schedule_running(self, b: StepBuilder) -> None:
        scheduled = b.scheduled
        # Requests admitted earlier in this step (prefill-first) are already scheduled.
        todo = [r for r in self.running if r.request_id not in scheduled] if scheduled else (
            self.running)
        # NOTE: decodes are charged in runs (the one decode path): a run of requests that
        # decode, up to the budget, takes one slot each, in order, and a new block each
        # at a block boundary while the pool has one. The first that finds no block gets
        # room made for it (``_make_room``: preemption, or it waits a step) and the run
        # goes on from it; a request with prompt work goes through ``_schedule_one``.
        # Measured by ``benchmarks/scheduler_overhead.py``: at 1,024 running requests a
        # step costs ~40% less than charging the decodes one by one.
        k = _leading_decodes(todo, 0, b.budget)
        allocate_decodes = self.kv.allocate_decodes
        if k:
            k, new_blocks = allocate_decodes(todo[:k])
            if k:
                b.charge_decodes(todo[:k], new_blocks)
        if k == len(todo):
            return
        # NOTE: a copy: preemptions edit ``running`` while the loop walks it; victims not
        # yet visited are skipped by their status.
        rest = todo[k:]
        i = 0
        while i < len(rest) and b.budget > 0:
            k = _leading_decodes(rest, i, b.budget)
            if not k:
                self._schedule_one(rest[i], b)
                i += 1
                continue
            k, new_blocks = allocate_decodes(rest[i:i + k])
            if k:
                b.charge_decodes(rest[i:i + k], new_blocks)
                i += k
            elif not self._make_room(rest[i], 1, b):
                i += 1  # it waits this step, or was preempted itself
        d = b.decisions
        if d is not None and i < len(rest):  # NOTE: the budget ran out
            d.left_out += [(r.request_id, Reason.BUDGET) for r in rest[i:] if r.status is _RUNNING]

    def _schedule_one(self, req: Request, b: StepBuilder) -> None:
        """The running pass for one request with prompt work: its next prompt chunk, if it
        gets the blocks (``_make_room``), or its group's fork."""
        if req.status is not _RUNNING:
            return  # preempted earlier in this pass
        remaining = req.num_tokens - req.num_computed_tokens
        if req.request_id in self._unforked:
            # NOTE: a group leader prefills up to its last prompt token, then forks.
            remaining = req.num_prompt_tokens - 1 - req.num_computed_tokens
            if remaining == 0:
                self._schedule_fork(req, b)
                return
        n = 1 if remaining == 1 else self._chunk(remaining, b.budget)
        new_ids = self.kv.allocate_slots(req, n)
        if new_ids is None:
            if not self._make_room(req, n, b):
                return
            new_ids = self.kv.allocate_slots(req, n)
            assert new_ids is not None, "_make_room freed the blocks"
        b.charge(req, n, remaining, new_ids)

    def _make_room(self, req: Request, n: int, b: StepBuilder) -> bool:
        """Free the blocks running ``req`` lacks for ``n`` more slots, preempting victims,
        or under cost-aware rules leave it out of this step instead (``_wait_instead``).
        True when the blocks are free and ``req`` still runs."""
        if self.config.cost_aware_preemption and self._wait_instead(req, n, b):
            return False
        if b.decisions is not None:
            b.decisions.cause = (Cause.BLOCKS, req.request_id)
        while self.kv.num_blocks_short(req, n):
            self._preempt(self._victim(b), b)
            if req.status is not _RUNNING:
                return False  # req itself (or its group) was preempted
        return True

    # -- the swapped pass ----------------------------------------------------------

    def _schedule_swapped(self, b: StepBuilder) -> None:
        # NOTE: no swap-in in a step that preempted: it would thrash, and a step never both
        # swaps out and swaps in (see ``_preempt``).
        if not self.swapped:
            return
        d = b.decisions
        if b.preempted:
            if d is not None:
                d.left_out += [(r.request_id, Reason.STEP_PREEMPTED) for r in self.swapped]
            return
        cfg, kv = self.config, self.kv
        for req in sorted(self.swapped, key=self.policy.key):
            if len(self.running) >= cfg.max_num_seqs or b.budget <= 0:
                if d is not None:
                    d.left_out.append((req.request_id, Reason.SEATS if b.budget > 0
                                       else Reason.BUDGET))
                break
            remaining = req.num_tokens - req.num_computed_tokens
            n = 1 if remaining == 1 else self._chunk(remaining, b.budget)
            if n < remaining and self._num_partial(b) >= cfg.max_num_partial_prefills:
                if d is not None:
                    d.left_out.append((req.request_id, Reason.PARTIAL_PREFILLS))
                continue
            if not kv.can_swap_in(req, n):
                if d is not None:
                    d.left_out.append((req.request_id, Reason.BLOCKS))
                break
            pairs = kv.swap_in(req)
            new_ids = kv.allocate_slots(req, n)
            assert new_ids is not None, "can_swap_in promised room"
            self.swapped.remove(req)
            req.status = _RUNNING
            self.running.append(req)
            rid = req.request_id
            b.pinned.add(rid)
            if remaining > 1:
                self._prefilling.add(rid)
            b.swap_in.extend(pairs)
            b.swapped_in.append(rid)
            # NOTE: a swapped-in request's new blocks are its whole table.
            b.charge(req, n, remaining, kv.block_ids(rid))
            self.stats.num_blocks_swapped_in += len(pairs)

    # -- the waiting pass ----------------------------------------------------------

    def _schedule_waiting(self, b: StepBuilder) -> None:
        # NOTE: swapped requests come back before new work is admitted (no starvation), and
        # a step whose earlier passes preempted admits nothing new (that would only thrash;
        # a priority preemption for an admission below does not stop the pass).
        waiting = self.waiting
        if self.swapped or b.preempted or not len(waiting):
            if b.decisions is not None and len(waiting):
                b.decisions.stop(Reason.SWAPPED_FIRST if self.swapped else Reason.STEP_PREEMPTED,
                                 len(waiting))
            return
        d = b.decisions
        stop: Reason | None = None  # NOTE: what ended the pass, for ``d``
        cfg, kv = self.config, self.kv
        skipped: list[Request] = []
        reject = self.policy.reject
        room = AdmissionRoom(self) if cfg.cost_aware_preemption else None
        preempts = self.policy.preempts_running
        unforked = self._unforked
        reserved = sum(unforked.values()) if unforked else 0
        in_hand: Request | None = None
        try:
            while (len(waiting) and b.budget > 0
                   and len(self.running) + reserved < cfg.max_num_seqs):
                req = in_hand = waiting.pop()
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
                    stop = self._hold(req, Reason.SEATS, b)  # NOTE: a group is one unit
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
                            stop = self._hold(req, Reason.BLOCKS, b)
                            break
                        reserved = sum(unforked.values())
                        continue
                n = self._chunk(remaining, b.budget)
                if n < remaining:
                    # NOTE: without chunking the budget covers max_model_len (config check).
                    if not cfg.enable_chunked_prefill:  # wait for a step with room for all of it
                        stop = self._hold(req, Reason.WHOLE_PROMPT, b)
                        break
                    if self._num_partial(b) >= cfg.max_num_partial_prefills:
                        skipped.append(req)  # a shorter prompt behind it may still fit
                        if d is not None:
                            d.held.append((req.request_id, Reason.PARTIAL_PREFILLS))
                        continue
                if room is not None and room.short(num_hit + remaining, len(hits)) and (
                        not preempts or not any(r.priority > req.priority for r in self.running)):
                    # NOTE: keep the running requests' growth room, unless the request may
                    # preempt some of them for urgency anyway.
                    stop = self._hold(req, Reason.HEADROOM, b)
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
                    stop = self._hold(req, Reason.BLOCKS, b)
                    break
                self._admit(req, n, num_hit, new_ids, b)
                if room is not None:
                    room.admitted(req, num_hit + n, num_hit + remaining)
                if group is not None:
                    reserved = sum(unforked.values())
        except BaseException:
            # NOTE: the step fails and is abandoned (``schedule``): the requests this pass
            # took off the queue and has not placed yet go back to it, none lost.
            self._put_back(in_hand, skipped)
            raise
        if skipped:
            waiting.add_front(skipped)
        if d is not None and len(waiting):
            if stop is None:  # NOTE: the loop's own conditions ended it
                stop = Reason.BUDGET if b.budget <= 0 else (
                    Reason.SEATS if len(self.running) + reserved >= cfg.max_num_seqs
                    else Reason.POLICY_ORDER)
            d.stop(stop, len(waiting))

    def _hold(self, req: Request, reason: Reason, b: StepBuilder) -> Reason:
        """Put ``req`` back at the head of the waiting queue, held for ``reason``."""
        self.waiting.add_front([req])
        if b.decisions is not None:
            b.decisions.held.append((req.request_id, reason))
        return reason

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

    # -- the decided step ----------------------------------------------------------

    def _commit_admissions(self, b: StepBuilder) -> None:
        """Count the admissions the step kept: prefix lookups (a first admission) or the
        tokens to recompute (a readmission), and first scheduled times.

        NOTE: after every pass, so an admission given back later in the same step
        (``_unadmit``) was never counted here (the host tier's own load counts excepted,
        see ``_unadmit``)."""
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

    def _build_output(self, b: StepBuilder) -> SchedulerOutput:
        """The executor's view of the decided step. Hands over the requests finished since
        the last step (``_finished_ids`` is emptied) and, with a host tier, the step's loads
        and stores (``take_transfers``)."""
        requests, scheduled, new_blocks = self.requests, b.scheduled, b.new_blocks
        # NOTE: admitted and forked requests are new to the executor (-> tokens cached).
        admitted = {**b.admitted, **b.forked} if b.forked else b.admitted
        swapped_in = set(b.swapped_in)
        new_requests = [
            NewRequestData(
                request_id=rid,
                prompt_token_ids=(req := requests[rid]).prompt_token_ids,
                output_token_ids=list(req.output_token_ids),
                sampling_params=req.sampling_params,
                block_ids=new_blocks[rid],
                num_computed_tokens=num_hit,
                stop_ids=req.stop_ids,
            )
            for rid, num_hit in admitted.items()
        ]
        ids = [rid for rid in scheduled if rid not in admitted] if admitted else list(scheduled)
        cached = CachedRequestData(
            ids,
            [new_blocks.get(rid) or [] for rid in ids] if new_blocks else [[] for _ in ids],
            [requests[rid].num_computed_tokens for rid in ids],
            [rid in swapped_in for rid in ids] if swapped_in else [False] * len(ids),
        )
        out = SchedulerOutput(
            step=self.step_index,
            new_requests=new_requests,
            cached_requests=cached,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=b.token_budget - b.budget,
            blocks_to_swap_out=b.swap_out,
            blocks_to_swap_in=b.swap_in,
            blocks_to_copy=b.copies,
            finished_request_ids=self._finished_ids,
            preempted_request_ids=[rid for rid, _ in b.preempted],
            swapped_out_request_ids=[rid for rid, mode in b.preempted if mode == "swap"],
        )
        if not self.kv.plain_lru:
            out.blocks_to_load, out.blocks_to_offload, out.kv_load_choices = (
                self.kv.take_transfers())
        self._finished_ids = []
        return out

    # -- shared by the passes ------------------------------------------------------

    def _chunk(self, remaining: int, budget: int) -> int:
        cap = self._chunk_cap
        if cap and remaining > cap:
            remaining = cap
        return remaining if remaining < budget else budget

    def _num_partial(self, b: StepBuilder) -> int:
        """Running requests whose prefill stays unfinished after this step, whichever pass
        scheduled (or skipped) them: the one count ``max_num_partial_prefills`` caps.

        NOTE: computed from state, not accumulated by the passes, so it cannot depend on
        the order they run in. It walks ``_prefilling`` (admitted or swapped in with prompt
        tokens left, pruned here once their prefill is done), not every running request."""
        scheduled, requests, prefilling = b.scheduled, self.requests, self._prefilling
        count = 0
        for rid in list(prefilling):
            r = requests[rid]
            end = r.prefill_end
            if r.num_computed_tokens >= end:
                prefilling.discard(rid)  # its prefill is done
            elif r.num_computed_tokens + scheduled.get(rid, 0) < end:
                count += 1
        return count


def _leading_decodes(requests: list[Request], start: int, limit: int) -> int:
    """How many of the (at most ``limit``) requests from ``start`` on are running and decode
    (one token left, outputs so far) before the first that does not."""
    k = 0
    for r in requests[start:start + limit] if start or limit < len(requests) else requests:
        if r.status is not _RUNNING or not r.output_token_ids or (
            r.num_prompt_tokens + len(r.output_token_ids) - r.num_computed_tokens != 1
        ):
            break
        k += 1
    return k
