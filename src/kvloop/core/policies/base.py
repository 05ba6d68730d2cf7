"""Scheduling policies: the waiting-queue order and the preemption-victim rule.

A policy is looked up by name in ``POLICIES`` (a registry, not an if/elif chain). Its
``key`` orders requests from most to least urgent; the preemption victim is the running
request with the largest key (least urgent, then latest arrived).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from kvloop.core.request import Request

PolicyKey = Callable[[Request], tuple[float, ...]]
"""A total order: equal keys never occur (``arrival_order`` breaks ties). NOTE: this is
what rules out livelock: the most urgent running request is never a victim unless it is
alone, and a lone request always fits (requests that cannot are refused on arrival)."""


class WaitingQueue:
    """Requests waiting for admission, popped most-urgent first."""

    def add(self, request: Request) -> None:
        raise NotImplementedError

    def add_front(self, requests: Iterable[Request]) -> None:
        """Put back requests that were popped but not admitted, keeping their order."""
        raise NotImplementedError

    def pop(self) -> Request:
        raise NotImplementedError

    def remove(self, request: Request) -> bool:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Request]:
        raise NotImplementedError


class FCFSQueue(WaitingQueue):
    """Arrival order. A request preempted by recompute returns to the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        if request.num_preemptions:
            self._q.appendleft(request)
        else:
            self._q.append(request)

    def add_front(self, requests: Iterable[Request]) -> None:
        self._q.extendleft(reversed(list(requests)))

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> bool:
        try:
            self._q.remove(request)
        except ValueError:
            return False
        return True

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue(WaitingQueue):
    """Lowest ``priority`` value first, then earliest arrival (a heap, lazy removal)."""

    def __init__(self) -> None:
        # Entries are [priority, arrival_time, arrival_order, tie, request | None]; a
        # removed entry keeps its place with request None until it reaches the top.
        self._heap: list[list] = []
        self._live: dict[int, list] = {}
        """id(request) -> its live heap entry."""
        self._tie = itertools.count()

    def add(self, request: Request) -> None:
        if id(request) in self._live:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        entry = [
            request.priority,
            request.arrival_time,
            request.arrival_order,
            next(self._tie),
            request,
        ]
        self._live[id(request)] = entry
        heapq.heappush(self._heap, entry)

    def add_front(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add(request)

    def _prune(self) -> None:
        heap = self._heap
        while heap and heap[0][-1] is None:
            heapq.heappop(heap)
        if not heap:
            raise IndexError("the waiting queue is empty")

    def pop(self) -> Request:
        self._prune()
        request = heapq.heappop(self._heap)[-1]
        del self._live[id(request)]
        return request

    def remove(self, request: Request) -> bool:
        entry = self._live.pop(id(request), None)
        if entry is None:
            return False
        entry[-1] = None
        return True

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        return (e[-1] for e in sorted(self._live.values(), key=lambda e: e[:4]))


@dataclass(frozen=True)
class Policy:
    """A named scheduling policy."""

    name: str
    """The name users pass as ``policy`` / ``--scheduling-policy``."""
    make_queue: Callable[[], WaitingQueue]
    """Factory of the waiting queue in this policy's order."""
    key: PolicyKey
    """Urgency order: smaller is more urgent; the largest running key is the victim."""
    preempts_running: bool = False
    """A waiting request that does not fit may preempt running requests strictly less
    urgent than itself (otherwise it waits for blocks to free up)."""


POLICIES: dict[str, Policy] = {
    "fcfs": Policy("fcfs", FCFSQueue, lambda r: (r.arrival_time, r.arrival_order)),
    "priority": Policy(
        "priority", PriorityQueue, lambda r: (r.priority, r.arrival_time, r.arrival_order),
        preempts_running=True,
    ),
}


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {name!r}") from None
