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

    def peek(self) -> Request:
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

    def peek(self) -> Request:
        return self._q[0]

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
        self._heap: list[tuple[int, float, int, int, Request]] = []
        self._tie = itertools.count()
        self._removed: set[int] = set()
        self._size = 0

    def add(self, request: Request) -> None:
        heapq.heappush(
            self._heap,
            (
                request.priority,
                request.arrival_time,
                request.arrival_order,
                next(self._tie),
                request,
            ),
        )
        self._size += 1

    def add_front(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add(request)

    def _prune(self) -> None:
        heap = self._heap
        while heap and id(heap[0][-1]) in self._removed:
            self._removed.discard(id(heapq.heappop(heap)[-1]))

    def peek(self) -> Request:
        self._prune()
        return self._heap[0][-1]

    def pop(self) -> Request:
        self._prune()
        self._size -= 1
        return heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> bool:
        if id(request) in self._removed or not any(e[-1] is request for e in self._heap):
            return False
        self._removed.add(id(request))
        self._size -= 1
        return True

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Request]:
        live = [e for e in self._heap if id(e[-1]) not in self._removed]
        return (e[-1] for e in sorted(live, key=lambda e: e[:4]))


@dataclass(frozen=True)
class Policy:
    """A named scheduling policy."""

    name: str
    """The name users pass as ``policy`` / ``--scheduling-policy``."""
    make_queue: Callable[[], WaitingQueue]
    """Factory of the waiting queue in this policy's order."""
    key: PolicyKey
    """Urgency order: smaller is more urgent; the largest running key is the victim."""


POLICIES: dict[str, Policy] = {
    "fcfs": Policy("fcfs", FCFSQueue, lambda r: (r.arrival_time, r.arrival_order)),
    "priority": Policy(
        "priority", PriorityQueue, lambda r: (r.priority, r.arrival_time, r.arrival_order)
    ),
}


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {name!r}") from None
