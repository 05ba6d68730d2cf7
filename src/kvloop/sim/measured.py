"""Step times from a recorded run, as a cost model: the simulator with perfect step costs.

Simulating a served workload with the times its own steps took separates the two ways a
simulation can miss a real run: the cost model (what a step costs) and the loop (which
steps happen, when requests join and get their tokens). With :class:`MeasuredSteps` the cost
model is exact for every batch the real engine ran, so what is left is the loop's error.
``benchmarks/sim_fidelity.py`` prints it beside the cost model's; on kvloop's torch engine it
is 0.0–0.1% (``docs/simulator.md``), so its misses come from the cost model and the machine.
"""

from __future__ import annotations

import itertools
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence

from kvloop.core.stats import StepRecord
from kvloop.executor.simulated.cost_model import Chunk
from kvloop.executor.simulated.executor import StepCost

BatchKey = tuple[int, int, tuple[Chunk, ...], int]
"""(decodes, Σ their contexts, sorted (c, p) chunks, blocks swapped): what a cost model sees
of a step."""


def batch_key(num_decodes: int, decode_context: int, chunks: Iterable[Chunk],
              swap_blocks: int = 0) -> BatchKey:
    """The key of one batch, as ``CostModel.step_time`` receives it."""
    return num_decodes, decode_context, tuple(sorted(chunks)), swap_blocks


def record_key(rec: StepRecord) -> BatchKey:
    """The key of the batch a recorded step ran."""
    decodes = [e for e in rec.scheduled if e.num_tokens == 1]
    chunks = [(e.num_tokens, e.num_computed_tokens) for e in rec.scheduled if e.num_tokens > 1]
    swapped = rec.num_blocks_swapped_in + rec.num_blocks_swapped_out
    return batch_key(len(decodes), sum(e.num_computed_tokens + 1 for e in decodes), chunks,
                     swapped)


class MeasuredSteps:
    """A cost model that answers each batch with the time a recorded run measured for it.

    A step's time is from its start to the next step's start (what it held the engine for,
    bookkeeping included), or to its end when an idle wait followed it (``idle_after``, and
    the last step). So simulated steps start when the served ones did, and each token is
    stamped at the next step's start rather than its own step's end: later by the host time
    between the two (a few ms on a CPU). A batch the run ran several times (prompts of one
    length, say) is answered with its times in the order the run measured them, the last
    one again once they are used up: one instance serves one simulation. A batch the run
    never ran goes to ``fallback`` and is counted in ``misses``; with no fallback it raises
    ``KeyError``. A step with nothing to do costs 0.
    """

    def __init__(self, records: Sequence[StepRecord], *, idle_after: Iterable[int] = (),
                 fallback: StepCost | None = None) -> None:
        idle = set(idle_after)
        self.times: dict[BatchKey, deque[float]] = defaultdict(deque)
        """Measured seconds by batch, in the run's order."""
        for rec, nxt in itertools.pairwise([*records, None]):
            # NOTE: the steps that take time are those ``kvloop.sim.driver._ran`` counts:
            # tokens scheduled, or blocks swapped out.
            if not rec.scheduled and not rec.num_blocks_swapped_out:
                continue
            end = rec.end_time_s if nxt is None or rec.step in idle else nxt.time_s
            self.times[record_key(rec)].append(end - rec.time_s)
        self.fallback = fallback
        """Costs the batches the run never ran (None: they raise ``KeyError``)."""
        self.hits = 0
        """Batches answered from the run."""
        self.misses = 0
        """Batches the run never ran (costed by ``fallback``)."""

    def step_time(self, num_decodes: int, decode_context: int, chunks: Sequence[Chunk] = (),
                  swap_blocks: int = 0, block_size: int = 16) -> float:
        """Seconds the recorded run took for this batch (``CostModel.step_time``'s
        signature)."""
        if not num_decodes and not chunks and not swap_blocks:
            return 0.0
        key = batch_key(num_decodes, decode_context, chunks, swap_blocks)
        times = self.times.get(key)
        if times:
            self.hits += 1
            return times.popleft() if len(times) > 1 else times[0]
        if self.fallback is None:
            raise KeyError(f"no recorded step ran the batch {key}")
        self.misses += 1
        return self.fallback.step_time(num_decodes, decode_context, chunks, swap_blocks,
                                       block_size=block_size)
