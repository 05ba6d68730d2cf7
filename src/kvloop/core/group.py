"""Parallel sampling: ``n`` sequences from one prompt, sharing its KV.

The leader (the request as submitted, sample 0) prefills the prompt up to its last token
alone. Then the scheduler forks it (``Scheduler._fork``): n - 1 siblings join with the
leader's full prompt blocks shared through ref counts and the partial last block copied
(copy on write, ``SchedulerOutput.blocks_to_copy``), and every sequence computes the last
prompt token itself, so each samples its first token from its own logits and its own
random stream. From there each sequence decodes on its own; the group is admitted as one
unit (room for all n is required) and preempted as one unit.
"""

from __future__ import annotations

from dataclasses import replace

from kvloop.core.decisions import Cause
from kvloop.core.request import Request, RequestStatus
from kvloop.core.state import SchedulerState
from kvloop.core.step import StepBuilder

_RUNNING = RequestStatus.RUNNING


class SequenceGroup:
    """The n sequences of one request with ``SamplingParams.n > 1``."""

    __slots__ = ("forked", "members", "n")

    def __init__(self, leader: Request, n: int) -> None:
        self.n = n
        self.members: list[Request] = [leader]
        """The leader first, then the siblings in sample order once forked."""
        self.forked = False

    @property
    def leader(self) -> Request:
        return self.members[0]

    def sibling(self, index: int) -> Request:
        """Sample ``index`` (1 .. n-1) as a new request: same prompt, priority and salt;
        with a seed, seed + index (so seeded groups are reproducible and differ)."""
        leader = self.leader
        params = leader.sampling_params
        if params.seed is not None:
            params = replace(params, seed=params.seed + index)
        child = Request(
            f"{leader.request_id}#{index}",
            leader.prompt_token_ids,
            params,
            arrival_time=leader.arrival_time,
            priority=leader.priority,
            cache_salt=leader.cache_salt,
            eos_token_ids=leader.eos_token_ids,
        )
        child.group = self
        child.sample_index = index
        child.stop_ids = leader.stop_ids
        child.arrival_order = leader.arrival_order
        child.first_scheduled_time = leader.first_scheduled_time
        child.block_hashes = list(leader.block_hashes)
        return child


class GroupForking(SchedulerState):
    """Forking groups for ``Scheduler`` (its state: ``kvloop.core.state.SchedulerState``)."""

    def _schedule_fork(self, leader: Request, b: StepBuilder) -> None:
        """Fork a group whose leader computed all but its last prompt token: every sequence
        computes that token this step (one per sequence), or the group waits."""
        group = leader.group
        assert group is not None
        if b.budget < group.n or len(self.running) + group.n - 1 > self.config.max_num_seqs:
            return
        acquired: list[int] = []
        while leader.status is _RUNNING:
            ids = self.kv.allocate_slots(leader, 1)
            if ids is not None:
                acquired += ids  # NOTE: kept across retries: the executor must learn them
                if self._fork(leader, b):
                    b.charge(leader, 1, 1, acquired)
                    return
            if b.decisions is not None:
                b.decisions.cause = (Cause.FORK, leader.request_id)
            self._preempt(self._victim(b), b)

    def _fork(self, leader: Request, b: StepBuilder) -> bool:
        """Add the leader's siblings (its slot for the last prompt token is allocated):
        prompt blocks shared, the partial one copied, one token each charged. False, with
        nothing changed, when the pool cannot take them yet."""
        group = leader.group
        assert group is not None
        children = [group.sibling(i) for i in range(1, group.n)]
        copies = self.kv.fork(leader, children)
        if copies is None:
            return False
        computed = leader.num_computed_tokens
        for child in children:
            rid = child.request_id
            child.num_computed_tokens = computed
            child.status = _RUNNING
            self.requests[rid] = child
            self.running.append(child)
            ids = self.kv.allocate_slots(child, 1)
            assert ids is not None, "fork() checked the room"
            b.charge(child, 1, 1, self.kv.block_ids(rid))  # NOTE: its whole table: it is new
            b.forked[rid] = computed
            b.pinned.add(rid)
        b.pinned.add(leader.request_id)
        b.copies.extend(copies)
        group.members.extend(children)
        group.forked = True
        self._unforked.pop(leader.request_id, None)
        return True

    def _admit_and_fork(self, leader: Request, b: StepBuilder) -> bool:
        """Admit a group whose prompt is one token, forked at once (all or nothing)."""
        group = leader.group
        assert group is not None
        if b.budget < group.n or self.kv.num_free_blocks < group.n:
            return False
        leader.num_computed_tokens = 0
        new_ids = self.kv.allocate_slots(leader, 1)
        assert new_ids is not None
        self._admit(leader, 1, 0, new_ids, b)
        forked = self._fork(leader, b)
        assert forked, "the room for every sequence was checked"
        return True
