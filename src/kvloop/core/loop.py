"""One step of the loop: schedule -> execute -> update. The engine and the simulator both
drive the scheduler through ``run_step``, so the simulator runs the very loop the engine does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvloop.core.interface import Executor, ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from kvloop.core.request import Request
    from kvloop.core.scheduler import Scheduler


@dataclass(slots=True)
class StepResult:
    """What one step did."""

    scheduler_output: SchedulerOutput
    runner_output: ModelRunnerOutput | None
    """None when the executor raised."""
    touched: list[Request]
    """Requests that received tokens or finished this step (on failure: the failed ones)."""
    failed: list[Request]
    """Requests finished with an error because the executor raised (empty otherwise)."""
    error: Exception | None = None
    """What the executor raised, if it did."""


def run_step(scheduler: Scheduler, executor: Executor) -> StepResult:
    """Schedule one step, run it on ``executor`` and apply its results.

    NOTE: if the executor raises, or applying its results does, only the requests of this
    step fail (``"model step failed: <exc>"``; ``Scheduler.abandon_step``); the scheduler
    stays consistent and the loop goes on. ``schedule()`` undoes its own decisions before
    it raises.
    """
    out = scheduler.schedule()
    try:
        result = executor.execute(out)
    except Exception as exc:
        failed = scheduler.abandon_step(out, f"model step failed: {exc!r}")
        return StepResult(out, None, failed, failed, exc)
    try:
        touched = scheduler.update_from_output(out, result)
    except Exception as exc:
        if not scheduler.step_pending:
            raise  # the results were applied; what failed came after (the step's record)
        failed = scheduler.abandon_step(out, f"engine error applying the step: {exc!r}")
        return StepResult(out, None, failed, failed, exc)
    return StepResult(out, result, touched, [])
