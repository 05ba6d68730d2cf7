"""Taking requests off the device: the preemption the scheduling passes share.

Part of ``Scheduler`` (its state: ``kvloop.core.state.SchedulerState``). A victim is the
least urgent, latest-arrived running request that may go (``_pick_victim``, cost-aware:
``_spare``); it leaves by swap or recompute (``_preempt``), with its whole group if it has
one; a request admitted earlier in the same step is given back instead (``_unadmit``).
Under cost-aware rules a request may wait a step instead of preempting for it
(``_wait_instead``).
"""

from __future__ import annotations

from kvloop.core.decisions import Reason
from kvloop.core.request import Request, RequestStatus
from kvloop.core.state import SchedulerState
from kvloop.core.step import StepBuilder

_RUNNING = RequestStatus.RUNNING


class Preemption(SchedulerState):
    """Choosing victims and taking them off the device, for ``Scheduler``."""

    def _wait_instead(self, req: Request, n: int, b: StepBuilder) -> bool:
        """Cost-aware: leave ``req`` out of this step instead of preempting for it when
        this step already threw away a step's budget of work, or when requests finishing
        in this step (by length: certain) free the blocks it lacks."""
        if b.discarded >= self.config.max_num_batched_tokens:
            self.stats.num_preemptions_avoided += 1
            if b.decisions is not None:
                b.decisions.left_out.append((req.request_id, Reason.DISCARD_CAP))
            return True
        short = self.kv.num_blocks_short(req, n)
        if b.finishing_blocks is None:
            freeable = self.kv.num_freeable_blocks
            b.finishing_blocks = sum(
                freeable(r) for r in self.running
                if r.request_id in b.scheduled and r.output_token_ids
                and b.scheduled[r.request_id] == r.num_tokens - r.num_computed_tokens
                and len(r.output_token_ids) + 1 >= r.sampling_params.max_tokens)
        if 0 < short <= b.finishing_blocks:
            b.finishing_blocks -= short  # NOTE: promised to req, not to the next one
            self.stats.num_preemptions_avoided += 1
            if b.decisions is not None:
                b.decisions.left_out.append((req.request_id, Reason.FINISHING_BLOCKS))
            return True
        return False

    def _victim(self, b: StepBuilder) -> Request:
        victim = self._pick_victim(b, worse_than=None)
        assert victim is not None, "the request that needs room is never pinned"
        return victim

    def _pick_victim(self, b: StepBuilder, worse_than: Request | None) -> Request | None:
        """The running request to preempt now, or None if none may go.

        Candidates: running requests not swapped in or forked in this step; with
        ``worse_than``, only those strictly less urgent than it, not admitted in this step
        (so priority preemption cannot cycle). The least urgent, latest arrived candidate
        goes; under cost-aware preemption, of those not preempted ``max_preemptions`` times
        yet and that free a block (``_spare``).
        """
        key = self.policy.key
        if worse_than is None:
            candidates = [r for r in self.running if r.request_id not in b.pinned]
        else:
            bar = key(worse_than)
            candidates = [
                r
                for r in self.running
                if r.request_id not in b.pinned
                and r.request_id not in b.admitted
                and r.priority > worse_than.priority
                and key(r) > bar
            ]
        if not candidates:
            return None
        if not self.config.cost_aware_preemption or len(candidates) == 1:
            return max(candidates, key=key)
        return self._spare(candidates)

    def _spare(self, candidates: list[Request]) -> Request:
        """The least urgent candidate that has not been preempted ``max_preemptions`` times
        and frees at least one block (one whose blocks are all shared frees nothing), if
        any; else the least urgent.

        NOTE: urgency, not the work a victim loses, picks among the rest: choosing the
        victim that loses the fewest tokens (per block freed, prefix cache included) was
        measured to recompute less but to preempt older requests, whose return holds the
        queue's head for long: p99 TTFT 4-10x worse on Mooncake (docs/policies.md). The
        work is saved where it is cheaper: admission headroom (``_schedule_waiting``),
        waiting for finishing requests (``_wait_instead``) and the thrash bound here.
        In the running pass the requester itself is a candidate, so some choice always
        frees room or takes the requester off the device.
        """
        limit = self.config.max_preemptions
        pool = [r for r in candidates if r.num_preemptions < limit] or candidates
        pool.sort(key=self.policy.key, reverse=True)
        freeable = self.kv.num_freeable_blocks
        return next((r for r in pool if freeable(r)), pool[0])

    def _preempt(self, victim: Request, b: StepBuilder) -> None:
        """Take ``victim`` (already chosen) off the device, with its whole group if it has
        one; undo their share of this step."""
        group = victim.group
        if group is not None and group.forked:
            for member in [m for m in group.members if m.status is _RUNNING]:
                self._preempt_one(member, b)
        else:
            self._preempt_one(victim, b)

    def _preempt_one(self, victim: Request, b: StepBuilder) -> None:
        rid = victim.request_id
        if rid in b.admitted:
            self._unadmit(victim, b)
            return
        self.running.remove(victim)
        self._prefilling.discard(rid)
        self._unforked.pop(rid, None)
        b.uncharge(rid)
        # NOTE: a step never both swaps in and swaps out, so host blocks released by a
        # swap-in cannot be overwritten by a swap-out before they are read (and vice versa).
        # NOTE: cost-aware: a victim with at most one block of work recomputes it (cheaper
        # than copying a block out and back, and it keeps the host tier for long contexts).
        swap = (
            self.config.preemption_mode == "swap"
            and not b.swap_in
            and victim.num_computed_tokens > (
                self.kv.block_size if self.config.cost_aware_preemption else 0)
            and (victim.group is None or victim.group.forked)  # NOTE: leaders recompute
            and self.kv.can_swap_out(victim)
        )
        victim.num_preemptions += 1
        self.stats.num_preemptions += 1
        if swap:
            pairs = self.kv.swap_out(victim)
            b.swap_out.extend(pairs)
            victim.status = RequestStatus.SWAPPED
            self.swapped.append(victim)
            self.stats.num_swap_preemptions += 1
            self.stats.num_blocks_swapped_out += len(pairs)
            b.preempted.append((rid, "swap"))
        else:
            b.discarded += victim.num_computed_tokens
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.PREEMPTED
            self.waiting.add(victim)
            self.stats.num_recompute_preemptions += 1
            b.preempted.append((rid, "recompute"))
        b.preempted_ids.add(rid)
        d = b.decisions
        if d is not None:
            d.preempt_causes.append((rid, *d.cause))

    def _unadmit(self, req: Request, b: StepBuilder) -> None:
        """Give back an admission made earlier in this step (prefill-first, when the
        running pass needs its blocks): the request waits again as if it had never been
        popped (its prefix lookup and recompute were not counted yet:
        ``_commit_admissions``).

        NOTE: with a host prefix tier, the loads its host hits queued still run in this
        step (and are counted by the tier): the device blocks they fill are freed cached,
        so its readmission finds them on the device unless they were reused meanwhile.
        Loading into a block reused in the same step is harmless: the new owner's KV is
        written after the load, and only its computed slots are ever read."""
        rid = req.request_id
        self.running.remove(req)
        self._prefilling.discard(rid)
        self._unforked.pop(rid, None)
        b.uncharge(rid)
        self.kv.free(req)
        req.status = RequestStatus.WAITING if req.num_preemptions == 0 else (
            RequestStatus.PREEMPTED)
        req.num_computed_tokens = 0
        self.waiting.add_front([req])
        if b.decisions is not None:
            b.decisions.held.append((rid, Reason.GIVEN_BACK))
