"""What every scheduling policy is made of: a waiting queue and an urgency order.

A ``Policy`` is one object per scheduler (it may keep state: counters, estimates). The
scheduler asks it for the waiting queue, the urgency ``key`` of a request (victims are the
least urgent), and, where the policy needs
them, a per-step token cap, a rejection test and a hook after every step. Hooks a policy
does not use stay ``None`` so the scheduler's hot path skips them.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, ClassVar

from kvloop.core.request import Request

if TYPE_CHECKING:
    from kvloop.config import SchedulerConfig
    from kvloop.core.interface import SchedulerOutput

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

    def peek(self) -> Request:
        return self._q[0]

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


class KeyedQueue(WaitingQueue):
    """Smallest ``key`` first (a heap with lazy removal). NOTE: the key of a waiting
    request must not change while it waits (aging is built into the key, not applied to it).
    """

    def __init__(self, key: PolicyKey) -> None:
        self._key = key
        # Entries are [*key, tie, request | None]; a removed entry keeps its place with
        # request None until it reaches the top.
        self._heap: list[list] = []
        self._live: dict[int, list] = {}
        """id(request) -> its live heap entry."""
        self._tie = itertools.count()

    def add(self, request: Request) -> None:
        if id(request) in self._live:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        entry = [*self._key(request), next(self._tie), request]
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

    def peek(self) -> Request:
        self._prune()
        return self._heap[0][-1]

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
        return (e[-1] for e in sorted(self._live.values(), key=lambda e: e[:-1]))


class Policy:
    """How one scheduler orders waiting work and chooses victims. Subclasses set ``name``
    and override what they change; one instance serves one scheduler."""

    name: ClassVar[str] = ""
    """The name users pass as ``policy`` / ``--scheduling-policy``."""
    preempts_running: ClassVar[bool] = False
    """A waiting request that does not fit may preempt running requests strictly less
    urgent than itself (otherwise it waits for blocks to free up)."""

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self.waiting: WaitingQueue = self.make_queue()
        self.token_cap: Callable[[list[Request]], int | None] | None = None
        """When set: the most tokens the next step may take, given the running requests
        (None from it: no cap beyond ``max_num_batched_tokens``)."""
        self.reject: Callable[[Request, float], str | None] | None = None
        """When set: asked for each request popped from the waiting queue (never run yet)
        at the step's start time; a message means it is finished as ``rejected``."""
        self.on_step: Callable[[SchedulerOutput, dict[str, Request], float], None] | None = None
        """When set: called once per step before its results are applied, with the step,
        the unfinished requests and its start time."""

    def make_queue(self) -> WaitingQueue:
        return KeyedQueue(self.key)

    def key(self, request: Request) -> tuple[float, ...]:
        """Urgency order: smaller is more urgent; the largest running key is the victim."""
        return (request.arrival_time, request.arrival_order)

    def forget(self, request: Request) -> None:
        """The request finished: drop whatever the policy kept about it."""
