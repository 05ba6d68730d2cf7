"""A request's life in ``Scheduler`` outside the step itself: arriving (or refused at
once when it can never run), finishing from outside the loop (an abort, a stop string),
failing with a step the executor could not run; and the invariants the tests assert after
every step.

Part of ``Scheduler`` (its state: ``kvloop.core.state.SchedulerState``).
"""

from __future__ import annotations

from kvloop.core.group import SequenceGroup
from kvloop.core.interface import SchedulerOutput
from kvloop.core.request import Request, RequestStatus
from kvloop.core.state import SchedulerState
from kvloop.core.step import StepBuilder
from kvloop.request_fields import kv_blocks_needed

_RUNNING = RequestStatus.RUNNING


class RequestLifecycle(SchedulerState):
    """Requests in and out of ``Scheduler``, a failed step's undoing, and the invariants."""

    # -- requests in and out -------------------------------------------------------

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

    # -- queries -------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- a step the executor could not run -----------------------------------------

    def abandon_step(self, scheduler_output: SchedulerOutput, error: str) -> list[Request]:
        """The executor failed this step: finish its requests with ``error``, restore the
        ones it swapped out, and go on. Returns the failed requests.

        NOTE: every request whose KV the step may have touched ends failed or exactly
        restored, never silently wrong: the scheduled ones (chunks, decodes, swap-ins) fail;
        the ones swapped out in this step may have host blocks that were never written (the
        step can die before its copies), so they are preempted by recompute instead, from
        their tokens. Their device blocks keep only hashes of KV computed in earlier,
        successful steps, and blocks reused in this step lost their hashes when handed out.
        """
        b = self._step
        if b is None:
            raise RuntimeError("abandon_step() without a scheduled step")
        self._step = None
        return self._abandon(b, error)

    @property
    def step_pending(self) -> bool:
        """A step was scheduled and its results are not applied yet."""
        return self._step is not None

    def _abandon(self, b: StepBuilder, error: str) -> list[Request]:
        failed = []
        self.kv.abandon_transfers()  # NOTE: loads and stores of the step may not have run
        # NOTE: swapped-in requests too, even if a failed schedule() did not charge them yet.
        for rid in dict.fromkeys([*b.scheduled, *b.pinned]):
            req = self.requests.get(rid)
            if req is not None and req.status is _RUNNING:
                req.error = error
                self.running.remove(req)
                self._finish(req, RequestStatus.FINISHED_ERROR)
                failed.append(req)
        for rid, mode in b.preempted:
            req = self.requests.get(rid)
            if mode == "swap" and req is not None and req.status is RequestStatus.SWAPPED:
                self.swapped.remove(req)
                released = self.kv.drop_swapped(req)
                req.num_computed_tokens = 0
                req.status = RequestStatus.PREEMPTED
                self.waiting.add(req)
                # NOTE: the executor kept its state for the swap-in that will not come.
                self._finished_ids.append(rid)
                st = self.stats
                st.num_swap_preemptions -= 1
                st.num_recompute_preemptions += 1
                st.num_blocks_swapped_out -= released
        self.step_index += 1
        return failed

    def _put_back(self, in_hand: Request | None, skipped: list[Request]) -> None:
        """Return to the waiting queue the requests a failing waiting pass held: those it
        skipped, and the one in hand unless it was placed (admitted, finished, queued)."""
        back = list(skipped)
        if (in_hand is not None and in_hand.request_id in self.requests
                and in_hand.status is not _RUNNING and all(r is not in_hand for r in skipped)
                and all(r is not in_hand for r in self.waiting)):
            self.kv.free(in_hand)  # NOTE: blocks it may have got before the failure
            in_hand.num_computed_tokens = 0
            back.append(in_hand)
        if back:
            self.waiting.add_front(back)

    # -- checks --------------------------------------------------------------------

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
