"""Length-aware orders: shortest predicted job first, and a skip-join multi-level queue.

Both rank a request by its *work*: prompt tokens still to compute plus output tokens
(each weighted ``OUTPUT_WEIGHT``, as a decode token holds a seat and a KV slot for a whole
step while a prompt token shares one). Both keep the aging bound of ``priority``: the
waiting key is ``arrival + aging_s * scale``, with ``scale`` in [0, 1] growing with the
work, so NOTE: a request is admitted before every request that arrives more than
``aging_s`` after it, whatever their lengths (``aging_s`` 0: a strict order by work, which
may starve long requests).

- ``sjf`` (learning to rank, Fu et al. 2024): the work left by the prediction of a
  ``length_predictor`` (``kvloop.core.policies.predict``): the remaining prompt plus the
  predicted output not yet generated.
- ``mlfq`` (FastServe's skip-join multi-level feedback queue, Wu et al. 2023): levels of
  quanta doubling from ``QUANTUM`` units of attained service. A new request joins the
  level its prompt's work reaches (skip-join: a long prompt skips the first levels) and
  sinks a level each time its service doubles; within a level, arrival order. It needs no
  prediction. Running requests are not preempted for waiting ones: levels order admission
  and re-admission, and the lowest level's newest request is the victim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvloop.core.policies.base import Policy
from kvloop.core.policies.predict import LengthPredictor, make_predictor
from kvloop.core.request import Request

if TYPE_CHECKING:
    from kvloop.config import SchedulerConfig

OUTPUT_WEIGHT = 16.0
"""Work units per output token (a prompt token is one)."""
WORK_FLOOR = 16.0
"""Work at or below which ``scale`` is 0."""
WORK_CAP = float(1 << 22)
"""Work at or above which ``scale`` is 1 (a 128k prompt with 16k output tokens is below)."""
QUANTUM = 256.0
"""Work units of ``mlfq``'s first level; level ``k`` ends at ``QUANTUM * 2**k``."""
MAX_LEVEL = int(math.log2(WORK_CAP / QUANTUM))
"""``mlfq``'s last level: its quantum reaches ``WORK_CAP``."""


def work_scale(work: float) -> float:
    """Work mapped into [0, 1] on a log scale between ``WORK_FLOOR`` and ``WORK_CAP``."""
    if work <= WORK_FLOOR:
        return 0.0
    return min(1.0, math.log(work / WORK_FLOOR) / math.log(WORK_CAP / WORK_FLOOR))


def aged_key(request: Request, aging_s: float, scale: float, rank: float
             ) -> tuple[float, ...]:
    """``arrival + aging_s * scale`` (the starvation bound), or without aging ``rank``
    first."""
    if aging_s > 0:
        return (request.arrival_time + aging_s * scale, request.arrival_order)
    return (rank, request.arrival_time, request.arrival_order)


class SJFPolicy(Policy):
    """Shortest predicted remaining work first, aged by ``aging_s``."""

    name = "sjf"

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float]) -> None:
        self.predictor: LengthPredictor = make_predictor(config.length_predictor,
                                                         config.predictor_tau)
        """Where the output lengths come from (its ``pairs`` report how well it did)."""
        super().__init__(config, clock)

    def work(self, request: Request) -> float:
        """Predicted work left: the prompt (and recompute) left plus the output left."""
        left = self.predictor.predict(request) - len(request.output_token_ids)
        prompt = max(0, request.num_tokens - request.num_computed_tokens)
        return prompt + OUTPUT_WEIGHT * max(1.0, left)

    def key(self, request: Request) -> tuple[float, ...]:
        work = self.work(request)
        return aged_key(request, self.config.aging_s, work_scale(work), work)

    def forget(self, request: Request) -> None:
        self.predictor.forget(request)


def mlfq_level(request: Request) -> int:
    """The level of a request's attained service: its prompt (the skip-join) plus the
    output it has generated."""
    attained = request.num_prompt_tokens + OUTPUT_WEIGHT * len(request.output_token_ids)
    if attained <= QUANTUM:
        return 0
    return min(MAX_LEVEL, math.ceil(math.log2(attained / QUANTUM)))


class MLFQPolicy(Policy):
    """Skip-join multi-level feedback queue on attained service, aged by ``aging_s``."""

    name = "mlfq"

    def key(self, request: Request) -> tuple[float, ...]:
        level = mlfq_level(request)
        return aged_key(request, self.config.aging_s, level / MAX_LEVEL, level)
