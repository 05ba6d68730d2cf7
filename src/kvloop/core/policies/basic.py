"""The two classic orders: first come first served, and static priority (with aging)."""

from __future__ import annotations

from kvloop.core.policies.base import FCFSQueue, Policy, WaitingQueue
from kvloop.core.request import Request


class FCFSPolicy(Policy):
    """Arrival order (vLLM's default). Victims: the latest arrived."""

    name = "fcfs"

    def make_queue(self) -> WaitingQueue:
        return FCFSQueue()


class PriorityPolicy(Policy):
    """Lowest ``priority`` first, then arrival; a waiting request may preempt running ones
    of a strictly lower priority.

    Aging: a request gains one priority level per ``aging_s`` seconds of waiting. At any
    time ``now`` its effective urgency is ``priority - (now - arrival) / aging_s``, which
    orders requests exactly as the fixed key ``priority * aging_s + arrival`` does (``now``
    is common to all), so the heap never needs re-keying. NOTE: the starvation bound: a
    request of priority ``p`` is ahead of every request that arrives more than
    ``(p - p_min) * aging_s`` seconds after it, so with bounded arrivals it is admitted.
    """

    name = "priority"
    preempts_running = True

    def key(self, request: Request) -> tuple[float, ...]:
        aging = self.config.aging_s
        if aging > 0:
            return (request.priority * aging + request.arrival_time, request.arrival_order)
        return (request.priority, request.arrival_time, request.arrival_order)
