"""Why the scheduler did what it did in one step: reasons as enums, kept only when recording.

``schedule()`` attaches a ``Decisions`` to its ``StepBuilder`` only when a step recorder is
attached; every hook in the passes is one ``is not None`` test otherwise. A hook appends a
request id and an enum member (no formatting); the words are ``describe_reason`` and
``describe_cause``, used by the viewers, never by the loop.
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """Why a request that could have computed tokens in a step did not."""

    BUDGET = "budget"
    """The step's token budget was spent."""
    BLOCKS = "blocks"
    """Not enough free KV blocks for its tokens."""
    SEATS = "seats"
    """``max_num_seqs`` requests were running (or reserved by a group)."""
    PARTIAL_PREFILLS = "partial_prefills"
    """``max_num_partial_prefills`` prompts were already part-way through."""
    WHOLE_PROMPT = "whole_prompt"
    """Without chunked prefill its prompt must fit the budget left in one step."""
    HEADROOM = "headroom"
    """Cost-aware admission keeps free blocks for the running requests' growth."""
    POLICY_ORDER = "policy_order"
    """Behind the request the waiting pass stopped at, in the policy's order."""
    SWAPPED_FIRST = "swapped_first"
    """Swapped-out requests come back before new work is admitted."""
    STEP_PREEMPTED = "step_preempted"
    """The step preempted a request: nothing new is admitted or swapped in (thrashing)."""
    JUST_PREEMPTED = "just_preempted"
    """Preempted in this very step: never readmitted in the same step."""
    GIVEN_BACK = "given_back"
    """Admitted earlier in the step (prefill-first), then given back for its blocks."""
    FINISHING_BLOCKS = "finishing_blocks"
    """Cost-aware: waits a step for blocks that finishing requests free, not preempting."""
    DISCARD_CAP = "discard_cap"
    """Cost-aware: the step already threw away a budget's worth of work by preempting."""


class Cause(StrEnum):
    """Why a running request was preempted."""

    BLOCKS = "blocks"
    """Another running request needed KV blocks and none were free."""
    PRIORITY = "priority"
    """A more urgent waiting request needed its blocks (priority preemption)."""
    FORK = "fork"
    """A parallel-sampling group needed blocks to fork its sequences."""


REASON_WORDS: dict[str, str] = {
    Reason.BUDGET: "token budget spent",
    Reason.BLOCKS: "no free KV blocks",
    Reason.SEATS: "max sequences reached",
    Reason.PARTIAL_PREFILLS: "partial-prefill cap reached",
    Reason.WHOLE_PROMPT: "prompt does not fit the budget left (chunked prefill off)",
    Reason.HEADROOM: "keeping KV growth room for the running requests",
    Reason.POLICY_ORDER: "behind in policy order",
    Reason.SWAPPED_FIRST: "swapped-out requests come back first",
    Reason.STEP_PREEMPTED: "the step preempted: nothing new admitted",
    Reason.JUST_PREEMPTED: "preempted in this step",
    Reason.GIVEN_BACK: "given back: the running requests needed its blocks",
    Reason.FINISHING_BLOCKS: "waits for blocks that finishing requests free",
    Reason.DISCARD_CAP: "the step already discarded a budget of work",
}
"""Each reason in words (the web view carries the same table)."""

CAUSE_WORDS: dict[str, str] = {
    Cause.BLOCKS: "KV blocks needed by",
    Cause.PRIORITY: "priority: blocks needed by the more urgent",
    Cause.FORK: "KV blocks needed to fork",
}
"""Each preemption cause in words, followed by the request that needed the room."""


def describe_reason(reason: str) -> str:
    """A reason's words (its code itself if unknown, e.g. from a newer trace)."""
    return REASON_WORDS.get(reason, reason)


def describe_cause(cause: str, for_request: str) -> str:
    """A preemption cause's words, naming the request that needed the room."""
    words = CAUSE_WORDS.get(cause, cause)
    return f"{words} {for_request}" if for_request else words


class Decisions:
    """What one step decided beyond what it scheduled (only while a recorder records)."""

    __slots__ = ("cause", "held", "left_out", "num_behind", "preempt_causes", "stop_reason",
                 "used_before")

    def __init__(self, used_before: int) -> None:
        self.used_before = used_before
        """KV blocks in use when the step was scheduled."""
        self.held: list[tuple[str, Reason]] = []
        """Waiting requests the waiting pass examined and left waiting, with why."""
        self.stop_reason: Reason | None = None
        """Why the waiting pass stopped (or never ran) with requests still waiting."""
        self.num_behind = 0
        """Waiting requests the pass never examined (they wait for ``stop_reason``)."""
        self.left_out: list[tuple[str, Reason]] = []
        """Running or swapped-out requests that computed nothing this step, with why."""
        self.preempt_causes: list[tuple[str, Cause, str]] = []
        """(victim, cause, request that needed the room), as ``preempted`` lists them."""
        self.cause: tuple[Cause, str] = (Cause.BLOCKS, "")
        """The cause the next preemption is for (set by the pass that preempts)."""

    def stop(self, reason: Reason, num_waiting: int) -> None:
        """The waiting pass stopped with ``num_waiting`` requests left waiting (``held``
        among them)."""
        self.stop_reason = reason
        self.num_behind = max(0, num_waiting - len(self.held))
