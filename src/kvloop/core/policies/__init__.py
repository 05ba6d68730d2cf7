"""Scheduling policies, looked up by name in ``POLICIES`` (a registry, not an if/elif chain).

- ``fcfs``: arrival order (vLLM's default).
- ``priority``: lowest ``priority`` first, aged by ``aging_s``; may preempt running
  requests of a lower priority.
- ``slo``: earliest TTFT deadline (less predicted prefill) first; steps capped to keep the
  tightest TPOT target; late requests deferred or rejected.
- ``fair``: per-tenant fair share (the Virtual Token Counter).
- ``sjf``: shortest predicted work first (a ``length_predictor``), aged by ``aging_s``.
- ``mlfq``: skip-join multi-level feedback queue on attained service, aged by ``aging_s``.
- ``balanced``: ``slo``'s deadlines, shorter predicted work first among near deadlines,
  within ``fair``'s shares.

Every policy shares cost-aware preemption (``kvloop.core.preemption``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvloop.core.policies.balanced import BalancedPolicy
from kvloop.core.policies.base import FCFSQueue, KeyedQueue, Policy, PolicyKey, WaitingQueue
from kvloop.core.policies.basic import FCFSPolicy, PriorityPolicy
from kvloop.core.policies.fair import FairPolicy
from kvloop.core.policies.length import MLFQPolicy, SJFPolicy
from kvloop.core.policies.predict import PREDICTORS, LengthPredictor, make_predictor
from kvloop.core.policies.slo import SLOPolicy
from kvloop.core.policies.step_times import StepTimes

if TYPE_CHECKING:
    from kvloop.config import SchedulerConfig

POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (FCFSPolicy, PriorityPolicy, SLOPolicy, FairPolicy, SJFPolicy,
                        MLFQPolicy, BalancedPolicy)
}

__all__ = [
    "POLICIES",
    "PREDICTORS",
    "BalancedPolicy",
    "FCFSPolicy",
    "FCFSQueue",
    "FairPolicy",
    "KeyedQueue",
    "LengthPredictor",
    "MLFQPolicy",
    "Policy",
    "PolicyKey",
    "PriorityPolicy",
    "SJFPolicy",
    "SLOPolicy",
    "StepTimes",
    "WaitingQueue",
    "make_policy",
    "make_predictor",
]


def make_policy(config: SchedulerConfig, clock: Callable[[], float]) -> Policy:
    """The policy ``config.policy`` names, for one scheduler on ``clock``."""
    try:
        cls = POLICIES[config.policy]
    except KeyError:
        raise ValueError(
            f"policy must be one of {', '.join(POLICIES)}; got {config.policy!r}") from None
    return cls(config, clock)
