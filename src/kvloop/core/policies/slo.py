"""SLO-aware scheduling: earliest deadline first on TTFT, prefill capped to keep TPOT.

Each request has a TTFT target (its own ``slo_ttft`` or the scheduler's default) and maybe
a TPOT target. On arrival the policy predicts its prefill time from the steps it has
observed (``StepTimes``) and gives it a *latest start*: ``arrival + TTFT - prefill``.

- Waiting work is admitted by latest start, earliest first (least slack first); requests
  preempted after they produced tokens come back before any new one.
- A request whose latest start has passed can no longer meet its TTFT: under
  ``slo_overload="defer"`` it waits behind every request that still can; under
  ``"reject"`` it is finished as ``rejected`` when it reaches the head of the queue.
- NOTE: the starvation bound: a deferred request is served ahead of on-time work once it
  is ``aging_s`` past its deadline ``D``, and late requests go by deadline, so from
  ``D + aging_s`` on only requests due no later than ``D`` (arrived before it) are admitted
  before it: it starts by ``D + aging_s`` plus their service (one at a time).
- Each step's token budget is capped so that every running decode keeps its TPOT target
  on average: a request may spend the slack it has banked with faster steps (never below
  one token per running request plus a small prefill share, so prompts still progress).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from kvloop.core.policies.base import KeyedQueue, Policy, WaitingQueue
from kvloop.core.policies.step_times import StepTimes
from kvloop.core.request import Request

if TYPE_CHECKING:
    from kvloop.config import SchedulerConfig
    from kvloop.core.interface import SchedulerOutput

MIN_PREFILL_SHARE = 32
"""Tokens a TPOT-capped step still gives to prompt work beyond one per running request."""


class DeadlineQueue(WaitingQueue):
    """On-time requests by latest start; late ones (deferred) behind them by deadline,
    unless the first of those is ``aging_s`` past its deadline.

    NOTE: the late lane is ordered by deadline, not latest start: a request that is late
    on arrival (a tiny target) then cannot jump ahead of one that is already overdue and
    hold it back while on-time work keeps coming."""

    def __init__(self, policy: SLOPolicy) -> None:
        self._policy = policy
        self._on_time = KeyedQueue(policy.key)
        self._late = KeyedQueue(lambda r: (policy.deadline(r), r.arrival_order))
        self._defer = policy.config.slo_overload == "defer"

    def add(self, request: Request) -> None:
        self._policy.plan(request)
        self._on_time.add(request)

    def add_front(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add(request)

    def _lane(self) -> KeyedQueue:
        """The lane whose head goes next (moving requests that became late first)."""
        policy, on_time, late = self._policy, self._on_time, self._late
        now = policy.clock()
        if self._defer:
            while len(on_time) and policy.is_late(on_time.peek(), now):
                late.add(on_time.pop())
            if len(late) and now >= policy.deadline(late.peek()) + policy.config.aging_s:
                return late
        return on_time if len(on_time) else late

    def peek(self) -> Request:
        """The request ``pop`` would return now."""
        return self._lane().peek()

    def pop(self) -> Request:
        return self._lane().pop()

    def remove(self, request: Request) -> bool:
        return self._on_time.remove(request) or self._late.remove(request)

    def __len__(self) -> int:
        return len(self._on_time) + len(self._late)

    def __iter__(self) -> Iterator[Request]:
        yield from self._on_time
        yield from self._late


class SLOPolicy(Policy):
    """Earliest latest-start first, TPOT-capped steps, late requests deferred or rejected."""

    name = "slo"

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float]) -> None:
        self.times = StepTimes()
        """Step cost as observed on the scheduler's clock."""
        self._latest_start: dict[str, float] = {}
        """Request id -> its latest start, fixed when it first waits."""
        super().__init__(config, clock)
        self.token_cap = self._token_cap
        self.on_step = self._observe
        if config.slo_overload == "reject":
            self.reject = self._reject

    def make_queue(self) -> WaitingQueue:
        return DeadlineQueue(self)

    # -- targets -------------------------------------------------------------------
    def ttft(self, request: Request) -> float:
        target = request.slo_ttft or self.config.slo_ttft
        assert target is not None, "SchedulerConfig requires slo_ttft under 'slo'"
        return target

    def deadline(self, request: Request) -> float:
        """When its first token is due."""
        return request.arrival_time + self.ttft(request)

    def plan(self, request: Request) -> None:
        """Fix the request's latest start the first time it waits."""
        if request.request_id in self._latest_start:
            return
        prefill = self.predict_prefill(request) if self.times.ready else 0.0
        self._latest_start[request.request_id] = self.deadline(request) - prefill
        # NOTE: entries go when the request leaves for good (``forget``); a request that
        # waits again (preempted) keeps its place.

    def forget(self, request: Request) -> None:
        self._latest_start.pop(request.request_id, None)

    def predict_prefill(self, request: Request) -> float:
        return self.times.prefill(request.num_prompt_tokens, self.config.max_num_batched_tokens)

    def latest_start(self, request: Request) -> float:
        ls = self._latest_start.get(request.request_id)
        return self.deadline(request) if ls is None else ls

    def is_late(self, request: Request, now: float) -> bool:
        """It never ran and can no longer start in time."""
        return request.num_preemptions == 0 and now > self.latest_start(request)

    def key(self, request: Request) -> tuple[float, ...]:
        # NOTE: requests that already produced tokens (preempted) come back first.
        fresh = 0.0 if request.output_token_ids else 1.0
        return (fresh, self.latest_start(request), request.arrival_order)

    # -- hooks ---------------------------------------------------------------------
    def _reject(self, request: Request, now: float) -> str | None:
        ttft = self.ttft(request)
        prefill = self.predict_prefill(request) if self.times.ready else 0.0
        if now + prefill <= request.arrival_time + ttft:
            return None
        return (f"cannot meet its TTFT target of {ttft:g} s: waited "
                f"{now - request.arrival_time:.3g} s and its prefill needs ~{prefill:.3g} s")

    def _token_cap(self, running: list[Request]) -> int | None:
        """Tokens the next step may take so that no running decode misses its TPOT target.

        TPOT is a per-request average, so a request may spend the slack it has banked: with
        ``k`` tokens out since its first at ``t1``, its average stays within ``T`` if the
        next step ends by ``t1 + T * k``. The step may take the least of these allowances
        (never less than ``T``, a normal decode step) over the running decodes.
        """
        if not self.times.ready:
            return None
        now = self.clock()
        default = self.config.slo_tpot
        allowed = float("inf")
        for r in running:
            first = r.first_token_time
            target = r.slo_tpot or default
            if first is None or target is None:
                continue
            own = target * len(r.output_token_ids) - (now - first)
            if own < target:
                own = target
            if own < allowed:
                allowed = own
        if allowed == float("inf"):
            return None  # no decode to protect
        return max(self.times.tokens_within(allowed), len(running) + MIN_PREFILL_SHARE)

    def _observe(self, out: SchedulerOutput, requests: dict[str, Request], start: float) -> None:
        self.times.observe(out.total_num_scheduled_tokens, self.clock() - start)
