"""Proof that the waiting pass admits nothing, step after step, while requests wait.

Fast-forward (``kvloop.core.fast_forward``) uses it to skip the waiting pass in the steps
of a saturated engine, where the queue's head waits for blocks or seats for many steps.
Where it proves nothing, the scheduler's own pass runs instead.

Only for ``fcfs`` and ``priority`` (a fixed urgency order, so the request the pass examines
first stays the queue's head) and with no running request less urgent than the head under
``priority`` (so it may not preempt). The pass then examines nothing when the seats or the
token budget are used up; otherwise it examines the head and stops there when its prompt
cannot be one chunk without chunked prefill, or when, under cost-aware preemption, the
blocks left after its prompt fall short of the running requests' growth headroom. That is
checked against an upper bound on the head's prefix hits (the hits when the gate is made:
blocks are only evicted meanwhile, and the hash that would extend them is watched, ending
the gate's life) and the exact free blocks and headroom of each step.

The examination's side effects are replayed (``examine``): the queue's pop and push back,
and the pruning of ``_prefilling`` by ``_num_partial`` when the head's prompt needs chunks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvloop.core.admission_room import HEADROOM_TOKENS
from kvloop.core.policies.basic import FCFSPolicy, PriorityPolicy

if TYPE_CHECKING:
    from kvloop.core.fast_forward import _Decoders
    from kvloop.core.request import Request
    from kvloop.core.scheduler import Scheduler


class WaitingGate:
    """Valid from the step it was made for while the running requests and the waiting
    queue stay as they are (no finish, admission or arrival) and ``stop`` is unset;
    ``admits_nothing`` is asked once per step, in order."""

    __slots__ = ("budget", "by_remaining", "decode_first", "evictions", "exact", "head",
                 "headroom", "hits", "made", "near", "num_waiting", "owner", "prune_now",
                 "static", "step", "stop", "target", "whole_blocks")

    def __init__(self, owner: Scheduler, step: int) -> None:
        self.owner = owner
        self.num_waiting = len(owner.waiting)
        self.made = step
        self.step = step - 1
        """The last step asked about."""
        self.head: Request | None = None
        """The request the pass examines (None: it examines nothing)."""
        self.stop = False
        """Set when the head's prefix hits could grow: the gate ends after this step."""
        self.decode_first = owner.config.scheduling_order == "decode-first"
        self.static = self.exact = self.prune_now = False
        self.target: bytes | None = None
        """The hash of the head's first block not in the prefix cache (None: none left)."""
        self.budget = self.hits = self.whole_blocks = self.headroom = self.near = 0
        self.evictions = owner.kv.pool.num_evictions
        """The pool's evictions when the head's hits were last looked up."""
        self.by_remaining: dict[int, int] = {}

    @classmethod
    def make(cls, owner: Scheduler, decodes: _Decoders, step: int) -> WaitingGate | None:
        """The gate from ``step`` on, or None when admitting nothing is not certain
        (``decodes``: the running requests, kept by fast-forward)."""
        cfg, kv, policy = owner.config, owner.kv, owner.policy
        if type(policy) not in (FCFSPolicy, PriorityPolicy):
            return None
        gate = cls(owner, step)
        n = len(owner.running)
        budget = cfg.max_num_batched_tokens - (n if gate.decode_first else 0)
        reserved = sum(owner._unforked.values())
        if n + reserved >= cfg.max_num_seqs or budget <= 0:
            return gate  # NOTE: no seat or no token for anyone until a finish or admission
        head = owner.waiting.peek()  # type: ignore[attr-defined]
        if head.group is not None and not head.group.forked:
            return None
        if policy.preempts_running and any(r.priority > head.priority for r in owner.running):
            return None
        total, chunked = head.num_tokens, cfg.enable_chunked_prefill
        fits = owner._chunk(total, budget) == total  # NOTE: one chunk even with no hits
        whole_blocks = kv.blocks_needed(total)
        room = kv.blocks_needed(HEADROOM_TOKENS * n)
        if (chunked or fits) and (not cfg.cost_aware_preemption
                                  or kv.num_free_blocks - n - whole_blocks >= room):
            return None  # NOTE: as below, whatever the hits: spare the lookup
        hits = kv.get_computed_blocks(head)  # NOTE: as the pass would (hashes are cached)
        remains = total - len(hits) * kv.block_size
        short = owner._chunk(remains, budget) < remains
        gate.static = short and not chunked
        if not gate.static and (not cfg.cost_aware_preemption
                                or kv.num_free_blocks - n - (whole_blocks - len(hits)) >= room):
            return None  # NOTE: no headroom kept, or more blocks left than any headroom
        gate.head, gate.budget, gate.hits, gate.whole_blocks = head, budget, len(hits), whole_blocks
        # NOTE: the head needs chunks now (``_num_partial`` prunes in the first step), or
        # may come to when its hits are evicted (``exact``: checked each step), or never.
        gate.prune_now = chunked and short
        gate.exact = chunked and not short and not fits
        limit = (total - 1) // kv.block_size
        if kv.enable_caching and len(hits) < limit:
            gate.target = head.block_hashes[len(hits)]
        remaining = decodes.remaining(step)
        gate.headroom = sum(r if r < HEADROOM_TOKENS else HEADROOM_TOKENS for r in remaining)
        gate.near = sum(1 for r in remaining if r <= HEADROOM_TOKENS)
        by_remaining = gate.by_remaining
        for r in remaining:
            if r > HEADROOM_TOKENS:
                by_remaining[r] = by_remaining.get(r, 0) + 1
        return gate

    def admits_nothing(self, step: int, free_after_decodes: int) -> bool:
        """Whether the waiting pass of ``step`` (the step after the last asked about)
        admits nothing, given the free blocks once its decodes have their blocks."""
        if step != self.step + 1:
            raise ValueError("a waiting gate is asked about consecutive steps only")
        self.step = step
        if self.head is None or self.static:
            return True
        if step > self.made:
            # NOTE: a request's headroom term min(left, 64) drops by one a step once
            # left <= 64: headroom(t + 1) = headroom(t) - #{left(made) <= 64 + t}.
            self.headroom -= self.near
            self.near += self.by_remaining.get(HEADROOM_TOKENS + step - self.made, 0)
        kv = self.owner.kv
        free = free_after_decodes if self.decode_first else kv.num_free_blocks
        left = free - (self.whole_blocks - self.hits)  # NOTE: an upper bound (hits only drop)
        return left < kv.blocks_needed(self.headroom)

    def examine(self) -> None:
        """Replay the examination of the head in the step being applied."""
        head = self.head
        if head is None:
            return
        owner = self.owner
        waiting = owner.waiting
        popped = waiting.pop()
        assert popped is head, "the head of the queue moved"
        waiting.add_front([popped])
        if self.prune_now:
            self.prune_now = False
            owner._prefilling.clear()  # NOTE: every running request decodes: all of them
        elif self.exact and owner.kv.pool.num_evictions != self.evictions:
            # NOTE: the head's hits only change when cached blocks are evicted
            kv = owner.kv
            self.evictions = kv.pool.num_evictions
            remains = head.num_tokens - len(kv.get_computed_blocks(head)) * kv.block_size
            if owner._chunk(remains, self.budget) < remains:
                self.exact = False
                owner._prefilling.clear()

    def after_commits(self) -> None:
        """Blocks were registered: if the head's next block is among them, stop."""
        if self.target is not None and self.target in self.owner.kv.pool.cached:
            self.stop = True
