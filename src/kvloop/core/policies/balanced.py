"""``balanced``: deadlines, fair shares and predicted lengths in one order.

- **Deadlines** (as ``slo``): each request has a latest start (TTFT deadline less its
  predicted prefill); a request that can no longer make it is deferred behind on-time work
  (or rejected, ``slo_overload``) until it is ``aging_s`` past its deadline; steps are
  capped so running decodes keep their TPOT target.
- **Length**: among requests with near deadlines the shorter goes first: the on-time key is
  ``latest start + TTFT target * scale(predicted work)`` (``kvloop.core.policies.length``),
  so a request can only be passed by one due less than its TTFT target later.
- **Fairness** (as ``fair``): tenants' service is counted by the Virtual Token Counter; the
  next request comes from a tenant whose counter is within ``FAIR_SLACK_STEPS`` steps'
  budget of the least-served backlogged tenant, the most urgent of those tenants' heads.
  NOTE: so the service gap between backlogged tenants stays within VTC's bound plus that
  slack, while deadlines and lengths decide among tenants that are close to even.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from kvloop.core.policies.base import WaitingQueue
from kvloop.core.policies.fair import FairPolicy
from kvloop.core.policies.length import OUTPUT_WEIGHT, work_scale
from kvloop.core.policies.predict import LengthPredictor, make_predictor
from kvloop.core.policies.slo import DeadlineQueue, SLOPolicy
from kvloop.core.request import Request

if TYPE_CHECKING:
    from kvloop.config import SchedulerConfig
    from kvloop.core.interface import SchedulerOutput

FAIR_SLACK_STEPS = 1.0
"""How far ahead of the least-served backlogged tenant (in steps' token budgets of
service) a tenant may be and still be served by urgency."""


class BalancedQueues(WaitingQueue):
    """One deadline queue per tenant; pops the most urgent head among the tenants close
    enough to the least served."""

    def __init__(self, policy: BalancedPolicy) -> None:
        self._policy = policy
        self._queues: dict[str, DeadlineQueue] = {}
        """Backlogged tenants only."""
        self._len = 0

    def add(self, request: Request) -> None:
        q = self._queues.get(request.tenant)
        if q is None:
            self._policy.fair.lift(request.tenant, self._queues)  # type: ignore[arg-type]
            q = self._queues[request.tenant] = DeadlineQueue(self._policy)
        q.add(request)
        self._len += 1

    def add_front(self, requests: Iterable[Request]) -> None:
        for request in requests:
            q = self._queues.get(request.tenant)
            if q is None:  # NOTE: no lift: just popped, its tenant was backlogged
                q = self._queues[request.tenant] = DeadlineQueue(self._policy)
            q.add(request)
            self._len += 1

    def _choose(self) -> str:
        if not self._queues:
            raise IndexError("the waiting queue is empty")
        policy = self._policy
        counters = policy.fair.counters
        floor = min(counters.get(t, 0.0) for t in self._queues)
        bar = floor + policy.slack
        now = policy.clock()
        best, best_rank = "", None
        for tenant, q in self._queues.items():
            if counters.get(tenant, 0.0) > bar:
                continue
            rank = policy.rank(q.peek(), now)
            if best_rank is None or rank < best_rank:
                best, best_rank = tenant, rank
        return best

    def peek(self) -> Request:
        return self._queues[self._choose()].peek()

    def pop(self) -> Request:
        tenant = self._choose()
        q = self._queues[tenant]
        request = q.pop()
        if not len(q):
            del self._queues[tenant]
        self._len -= 1
        return request

    def remove(self, request: Request) -> bool:
        q = self._queues.get(request.tenant)
        if q is None or not q.remove(request):
            return False
        if not len(q):
            del self._queues[request.tenant]
        self._len -= 1
        return True

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        for q in list(self._queues.values()):
            yield from q


class BalancedPolicy(SLOPolicy):
    """Earliest (length-adjusted) latest start first among tenants near their fair share;
    TPOT-capped steps; late requests deferred or rejected."""

    name = "balanced"

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float]) -> None:
        self.fair = FairPolicy(config, clock)
        """The tenants' service counters (its queue is unused)."""
        self.predictor: LengthPredictor = make_predictor(config.length_predictor,
                                                         config.predictor_tau)
        self.slack = FAIR_SLACK_STEPS * config.max_num_batched_tokens
        """Counter units a tenant may be ahead and still be served by urgency."""
        super().__init__(config, clock)

    def make_queue(self) -> WaitingQueue:
        return BalancedQueues(self)

    def work(self, request: Request) -> float:
        """Predicted work left (as ``sjf``)."""
        left = self.predictor.predict(request) - len(request.output_token_ids)
        prompt = max(0, request.num_tokens - request.num_computed_tokens)
        return prompt + OUTPUT_WEIGHT * max(1.0, left)

    def key(self, request: Request) -> tuple[float, ...]:
        fresh = 0.0 if request.output_token_ids else 1.0
        length = self.ttft(request) * work_scale(self.work(request))
        return (fresh, self.latest_start(request) + length, request.arrival_order)

    def rank(self, request: Request, now: float) -> tuple[float, ...]:
        """Urgency across tenants' heads: deferred (late, not yet aged) ones last."""
        deferred = (self.config.slo_overload == "defer" and self.is_late(request, now)
                    and now < self.deadline(request) + self.config.aging_s)
        return (float(deferred), *self.key(request))

    def forget(self, request: Request) -> None:
        super().forget(request)
        self.predictor.forget(request)

    def _observe(self, out: SchedulerOutput, requests: dict[str, Request], start: float) -> None:
        super()._observe(out, requests, start)
        self.fair.charge(out, requests, start)
