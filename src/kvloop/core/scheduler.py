"""The loop's decisions: which requests compute how many tokens in the next step.

One token budget and one sequence cap per step are spent on, in ``decode-first`` order:
running requests (a decode takes 1 token, a partial prefill its next chunk), swapped-out
requests coming back, then waiting requests in policy order. ``prefill-first`` admits
waiting requests before serving running ones. There are no prefill or decode phases: each
request has ``num_computed_tokens`` and ``num_tokens``, and a step mixes both kinds.

When a running request cannot get a KV slot, a victim (least urgent, latest arrived) is
preempted by recompute or swap. Under the ``priority`` policy a waiting request may also
preempt running requests that are strictly less urgent than itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core.admission import Admission
from kvloop.core.decisions import Cause, Decisions, Reason
from kvloop.core.fast_forward import FastForward
from kvloop.core.group import GroupForking, SequenceGroup
from kvloop.core.interface import CachedRequestData, NewRequestData, SchedulerOutput
from kvloop.core.kv_cache_manager import KVCacheManager
from kvloop.core.policies import make_policy
from kvloop.core.preemption import Preemption
from kvloop.core.request import Request, RequestStatus
from kvloop.core.results import StepResults
from kvloop.core.stats import SchedulerStats, StepRecorder
from kvloop.core.step import StepBuilder
from kvloop.request_fields import kv_blocks_needed

_RUNNING = RequestStatus.RUNNING


class Scheduler(StepResults, Preemption, GroupForking, Admission, FastForward):
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

    # -- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request, or finish it at once with an error if it can never run.

        NOTE: all or nothing: when this raises (a duplicate id, a policy that cannot order
        the request), the scheduler holds no trace of the request."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.status != RequestStatus.WAITING:
            raise ValueError(f"request {request.request_id!r} is not new")
        error = self._never_fits(request)
        if error is not None:
            self._record_arrival(request)
            request.error = error
            request.status = RequestStatus.FINISHED_ERROR
            request.finished_time = self.clock()
            self._count_finished(request)
            return
        params = request.sampling_params
        request.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else request.eos_token_ids
        )
        if params.n > 1:
            request.group = SequenceGroup(request, params.n)
        request.arrival_order = self._num_added
        self.waiting.add(request)  # NOTE: first: the policy's key may refuse the request
        self._num_added += 1
        self.requests[request.request_id] = request
        self._record_arrival(request)

    def _record_arrival(self, request: Request) -> None:
        if self.recorder is None:
            return
        self._arrived.append((request.request_id, request.arrival_time,
                              request.num_prompt_tokens))
        info = {name: value for name, value in (
            ("tenant", request.tenant), ("priority", request.priority),
            ("slo_ttft", request.slo_ttft or self.config.slo_ttft),
            ("slo_tpot", request.slo_tpot or self.config.slo_tpot)) if value}
        if info:
            self._arrived_info[request.request_id] = info

    def _never_fits(self, request: Request) -> str | None:
        cfg = self.config
        total = request.max_total_tokens
        if total > cfg.max_model_len:
            return (
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({request.max_tokens}) = {total} exceeds max_model_len ({cfg.max_model_len})"
            )
        n = request.sampling_params.n
        if n > cfg.max_num_seqs:
            return f"n ({n}) exceeds max_num_seqs ({cfg.max_num_seqs})"
        blocks = kv_blocks_needed(request.num_prompt_tokens, request.max_tokens, n,
                                  self.kv.block_size)
        if blocks > self.kv.num_gpu_blocks:
            return (
                f"request needs {blocks} KV blocks for {total} tokens"
                + (f" in each of {n} sequences" if n > 1 else "")
                + f" but the pool has only {self.kv.num_gpu_blocks}"
            )
        return None

    def abort_request(self, request_id: str) -> bool:
        """Abort a request in any state, freeing everything it holds. False if unknown."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> bool:
        """Finish an unfinished request from outside the loop (abort, stop string)."""
        if not status.finished:
            raise ValueError(f"{status.name} is not a finished status")
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request.status == _RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, status)
        return True

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished and release blocks; the caller has taken it out of its queue."""
        request.status = status
        request.finished_time = self.clock()
        self.kv.free(request)
        self.policy.forget(request)
        self._prefilling.discard(request.request_id)
        self._unforked.pop(request.request_id, None)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
        self._count_finished(request)

    def _count_finished(self, request: Request) -> None:
        reason = request.finish_reason
        key = reason.value if reason is not None else "unknown"
        by = self.stats.finished_by_reason
        by[key] = by.get(key, 0) + 1
        if self.recorder is not None:
            # NOTE: every finish reaches a step record: those inside update_from_output go
            # to its step; aborts, refusals and failed steps go to the next record.
            self._finished_log.append((request.request_id, key))

    # -- queries ---------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- one step --------------------------------------------------------------------
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
            # run, so the decisions are undone the way a failed step's are.
            self._step = None
            self._abandon(b, f"scheduler error: {exc!r}")
            raise

    def _build_output(self, b: StepBuilder) -> SchedulerOutput:
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

    def _schedule_running(self, b: StepBuilder) -> None:
        scheduled = b.scheduled
        # Requests admitted earlier in this step (prefill-first) are already scheduled.
        todo = [r for r in self.running if r.request_id not in scheduled] if scheduled else (
            self.running)
        # NOTE: the steady state in bulk. For a run of requests that decode (up to the
        # budget), as long as the pool has a block for each one at a block boundary, the
        # one-by-one loop would charge each one token, in order, preempting no one: the
        # same decisions (and block ids) as charging them at once, at a fraction of the
        # cost. It takes over from the first that finds no free block (or does not decode)
        # and hands the next run of decodes back.
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
            k = _leading_decodes(rest, i, b.budget) if i else 0
            if k:
                k, new_blocks = allocate_decodes(rest[i:i + k])
                if k:
                    b.charge_decodes(rest[i:i + k], new_blocks)
                    i += k
                    continue
            self._schedule_one(rest[i], b)
            i += 1
        d = b.decisions
        if d is not None and i < len(rest):  # NOTE: the budget ran out
            d.left_out += [(r.request_id, Reason.BUDGET) for r in rest[i:] if r.status is _RUNNING]

    def _schedule_one(self, req: Request, b: StepBuilder) -> None:
        """The running pass for one request: its next token or prompt chunk, if it gets the
        blocks (preempting for them, or waiting a step instead under cost-aware rules)."""
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
        allocate = self.kv.allocate_slots
        new_ids = allocate(req, n)
        if new_ids is None and self.config.cost_aware_preemption and self._wait_instead(
                req, n, b):
            return
        if b.decisions is not None:
            b.decisions.cause = (Cause.BLOCKS, req.request_id)
        while new_ids is None:
            self._preempt(self._victim(b), b)
            if req.status is not _RUNNING:
                return  # req itself (or its group) was preempted
            new_ids = allocate(req, n)
        b.charge(req, n, remaining, new_ids)

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

    # -- checks ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert queues, statuses and the KV cache agree (tests call it every step)."""
        self.kv.check_invariants()
        running = {r.request_id for r in self.running}
        swapped = {r.request_id for r in self.swapped}
        waiting = {r.request_id for r in self.waiting}
        assert len(running) == len(self.running), "a request is twice in running"
        assert len(waiting) == len(self.waiting), "waiting queue size drifted"
        assert not (running & swapped or running & waiting or swapped & waiting)
        assert running | swapped | waiting == set(self.requests), "a request is lost"
        assert len(self.running) <= self.config.max_num_seqs
        assert self.kv.device_owners() <= running, "a non-running request holds blocks"
        assert self.kv.host_owners() == swapped, "swapped table mismatch"
        bs = self.kv.block_size
        for r in self.running:
            assert r.status == _RUNNING, r
            blocks = len(self.kv.block_ids(r.request_id))
            assert blocks * bs >= r.num_computed_tokens, f"{r} lacks blocks"
            assert r.num_computed_tokens < r.num_tokens, f"{r} computed past its tokens"
            if r.num_computed_tokens < r.prefill_end:
                assert r.request_id in self._prefilling, f"{r} prefills untracked"
        assert self._prefilling <= running, "a non-running request is tracked as prefilling"
        for r in self.swapped:
            assert r.status == RequestStatus.SWAPPED, r
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), r
            assert r.num_computed_tokens == 0, r


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
