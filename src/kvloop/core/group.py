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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvloop.core.request import Request


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
        from kvloop.core.request import Request

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
