"""What the parts of ``Scheduler`` share, declared once.

``Scheduler`` (the step: ``kvloop.core.scheduler``) is assembled with parts, one per
concern outside the step's decisions (a request's life, forking groups, applying a step's
results, fast-forward), each a class deriving from :class:`SchedulerState`: they read and
write the one state ``Scheduler.__init__`` sets up, and call each other's methods, which
are declared here for type checkers only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvloop.config import CacheConfig, SchedulerConfig
    from kvloop.core.kv_cache_manager import KVCacheManager
    from kvloop.core.policies import Policy, WaitingQueue
    from kvloop.core.request import Request, RequestStatus
    from kvloop.core.results import Finished
    from kvloop.core.stats import SchedulerStats, StepRecorder
    from kvloop.core.step import StepBuilder


class SchedulerState:
    """The scheduler's state (see ``Scheduler.__init__`` for each field's meaning)."""

    config: SchedulerConfig
    cache_config: CacheConfig
    clock: Callable[[], float]
    recorder: StepRecorder | None
    policy: Policy
    kv: KVCacheManager
    stats: SchedulerStats
    requests: dict[str, Request]
    running: list[Request]
    swapped: list[Request]
    waiting: WaitingQueue
    step_index: int
    _step: StepBuilder | None
    _prefilling: set[str]
    _unforked: dict[str, int]
    _finished_ids: list[str]
    _num_added: int
    _arrived: list[tuple[str, float, int]]
    _arrived_info: dict[str, dict[str, object]]
    _finished_log: list[tuple[str, str]]
    _passes: tuple[Callable[[StepBuilder], None], ...]

    if TYPE_CHECKING:  # NOTE: each is defined by exactly one part of ``Scheduler``

        # Scheduler (the step)
        def _chunk(self, remaining: int, budget: int) -> int: ...
        def _num_partial(self, b: StepBuilder) -> int: ...
        def _admit(self, req: Request, n: int, num_hit: int, block_ids: list[int],
                   b: StepBuilder) -> None: ...
        def _commit_admissions(self, b: StepBuilder) -> None: ...

        # Preemption
        def _wait_instead(self, req: Request, n: int, b: StepBuilder) -> bool: ...
        def _victim(self, b: StepBuilder) -> Request: ...
        def _pick_victim(self, b: StepBuilder, worse_than: Request | None
                         ) -> Request | None: ...
        def _preempt(self, victim: Request, b: StepBuilder) -> None: ...

        # RequestLifecycle
        def _finish(self, request: Request, status: RequestStatus) -> None: ...
        def _abandon(self, b: StepBuilder, error: str) -> list[Request]: ...
        def _put_back(self, in_hand: Request | None, skipped: list[Request]) -> None: ...

        # GroupForking
        def _admit_and_fork(self, leader: Request, b: StepBuilder) -> bool: ...

        # StepResults
        def _apply_tokens(
            self, scheduled: Iterable[tuple[str, int]], sampled: Mapping[str, Sequence[int]],
            errors: Mapping[str, str] | None, now: float,
        ) -> tuple[list[Request], list[Request], Finished, int]: ...
        def _commit_chunks(self, chunked: list[Request]) -> None: ...
        def _finish_all(self, finished: Finished) -> None: ...
        def _count_step(self, gen_tokens: int, prompt_tokens: int) -> None: ...
