"""Fair share between tenants: the Virtual Token Counter (Sheng et al., OSDI 2024).

Each tenant (``Request.tenant``, the OpenAI ``user``) has a counter of the service it has
received: prompt tokens computed (weight 1) plus output tokens generated (weight 2, as in
the paper), divided by the tenant's weight. The waiting request admitted next is the
oldest of the backlogged tenant with the smallest counter, so a tenant cannot take more
than its share by sending more. A tenant that becomes backlogged has its counter lifted
to the smallest counter among the active tenants (backlogged ones, or else those served
in the last step that served anyone), so idling banks no credit.

NOTE: fairness survives preemption: counters are never rolled back, recomputed prompt
tokens are not charged again (``Request.num_served_tokens`` is a high-water mark), and
victims come from the most-served tenant.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from kvloop.core.policies.base import Policy, WaitingQueue
from kvloop.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvloop.config import SchedulerConfig
    from kvloop.core.interface import SchedulerOutput

PROMPT_WEIGHT = 1.0
"""Service units per prompt token computed."""
OUTPUT_WEIGHT = 2.0
"""Service units per output token generated."""


class TenantQueues(WaitingQueue):
    """One FIFO per tenant; pops from the least-served backlogged tenant."""

    def __init__(self, policy: FairPolicy) -> None:
        self._policy = policy
        self._queues: dict[str, deque[Request]] = {}
        """Backlogged tenants only (a tenant whose queue empties is dropped)."""
        self._len = 0

    def add(self, request: Request) -> None:
        tenant = request.tenant
        q = self._queues.get(tenant)
        if q is None:
            self._policy.lift(tenant, self._queues)
            q = self._queues[tenant] = deque()
        if request.num_preemptions:
            q.appendleft(request)
        else:
            q.append(request)
        self._len += 1

    def add_front(self, requests: Iterable[Request]) -> None:
        # NOTE: no lift: these were just popped, their tenant was backlogged.
        for request in reversed(list(requests)):
            self._queues.setdefault(request.tenant, deque()).appendleft(request)
            self._len += 1

    def pop(self) -> Request:
        if not self._queues:
            raise IndexError("the waiting queue is empty")
        counters = self._policy.counters
        tenant = min(self._queues, key=lambda t: (counters.get(t, 0.0),
                                                  self._queues[t][0].arrival_order))
        q = self._queues[tenant]
        request = q.popleft()
        if not q:
            del self._queues[tenant]
        self._len -= 1
        return request

    def remove(self, request: Request) -> bool:
        q = self._queues.get(request.tenant)
        if q is None:
            return False
        try:
            q.remove(request)
        except ValueError:
            return False
        if not q:
            del self._queues[request.tenant]
        self._len -= 1
        return True

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        for q in list(self._queues.values()):
            yield from q


class FairPolicy(Policy):
    """Virtual Token Counter fair share across tenants, weighted by ``tenant_weights``."""

    name = "fair"

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float]) -> None:
        self.counters: dict[str, float] = {}
        """Tenant -> weighted service received (prompt + 2 x output tokens) / weight."""
        self.weights = dict(config.tenant_weights)
        self._active: set[str] = set()
        """Tenants served in the last step that served anyone (so an idle engine still
        lifts a newcomer to where service stopped)."""
        super().__init__(config, clock)
        self.on_step = self.charge

    def make_queue(self) -> WaitingQueue:
        return TenantQueues(self)

    def key(self, request: Request) -> tuple[float, ...]:
        # NOTE: dynamic (counters move), so only used where keys are computed on demand:
        # victims (the most-served tenant's newest request) and swap-in order.
        return (self.counters.get(request.tenant, 0.0), request.arrival_time,
                request.arrival_order)

    def lift(self, tenant: str, backlogged: dict[str, deque[Request]]) -> None:
        """``tenant`` becomes backlogged: no less than the least-served active tenant."""
        counters = self.counters
        active = backlogged or self._active
        if not active:
            return
        floor = min(counters.get(t, 0.0) for t in active)
        if counters.get(tenant, 0.0) < floor:
            counters[tenant] = floor

    def charge(self, out: SchedulerOutput, requests: dict[str, Request], start: float) -> None:
        """Add one step's service to its tenants' counters."""
        counters, weights = self.counters, self.weights
        active: set[str] = set()
        for rid, n in out.num_scheduled_tokens.items():
            req = requests.get(rid)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            tenant = req.tenant
            active.add(tenant)
            after = req.num_computed_tokens + n
            units = 0.0
            served = req.num_served_tokens
            if after > served:
                p = req.num_prompt_tokens
                units += PROMPT_WEIGHT * max(0, min(after, p) - min(served, p))
                req.num_served_tokens = after
            if after >= req.num_tokens:
                units += OUTPUT_WEIGHT  # the step samples one output token
            if units:
                counters[tenant] = counters.get(tenant, 0.0) + units / weights.get(tenant, 1.0)
        if active:
            self._active = active
