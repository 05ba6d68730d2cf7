"""The simulated executor: predicts each step's time with a cost model, samples nothing.

It plays the role httpx's mock transport plays for httpx: the same contract as the real
model runner, no hardware behind it. Output lengths come from the workload (each request's
``max_tokens``), so every sampled token is a placeholder.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvloop.core.interface import ModelRunnerOutput, SchedulerOutput
from kvloop.executor.simulated.cost_model import Chunk

PLACEHOLDER_TOKEN = 0
_ONE = (PLACEHOLDER_TOKEN,)


class StepCost(Protocol):
    """What the simulated executor asks of a cost model (``CostModel``, or
    ``kvloop.sim.measured.MeasuredSteps``): the seconds of one step's batch."""

    def step_time(self, num_decodes: int, decode_context: int, chunks: Sequence[Chunk] = (),
                  swap_blocks: int = 0, block_size: int = 16) -> float: ...


class SimulatedExecutor:
    """Executor whose step time is the cost model's prediction for the scheduled batch."""

    def __init__(self, cost_model: StepCost, block_size: int) -> None:
        self.cost_model = cost_model
        self.block_size = block_size
        model = getattr(cost_model, "model", None)
        self.num_layers = max(1, int(getattr(model, "num_layers", 1)))
        """Layers a load of prefix blocks is pipelined over (1: not pipelined)."""

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        out = scheduler_output
        scheduled = out.num_scheduled_tokens
        num_decodes = 0
        decode_context = 0
        chunks: list[tuple[int, int]] = []
        for d in out.new_requests:
            c = scheduled[d.request_id]
            if c == 1:
                num_decodes += 1
                decode_context += d.num_computed_tokens + 1
            else:
                chunks.append((c, d.num_computed_tokens))
        cached = out.cached_requests
        ids, computed = cached.request_ids, cached.num_computed_tokens
        if sum(map(scheduled.__getitem__, ids)) == len(ids):
            # NOTE: the common case: every cached request decodes (each is scheduled >= 1)
            num_decodes += len(ids)
            decode_context += sum(computed) + len(ids)
        else:
            for rid, p in zip(ids, computed, strict=True):
                c = scheduled[rid]
                if c == 1:
                    num_decodes += 1
                    decode_context += p + 1
                else:
                    chunks.append((c, p))
        step_time = self.step_time(num_decodes, decode_context, chunks,
                                   len(out.blocks_to_swap_in) + len(out.blocks_to_swap_out))
        if out.blocks_to_load or out.blocks_to_offload:
            step_time = self._with_host_tier(step_time, len(out.blocks_to_load),
                                             len(out.blocks_to_offload))
        return ModelRunnerOutput(dict.fromkeys(scheduled, _ONE), step_time)

    def _copy_time(self, num_blocks: int) -> float:
        """Seconds to copy ``num_blocks`` over the host link (0 when the cost model cannot
        price a bare copy, as recorded step times may not)."""
        try:
            return self.cost_model.step_time(0, 0, (), num_blocks, block_size=self.block_size)
        except KeyError:
            return 0.0

    def _with_host_tier(self, compute: float, loads: int, stores: int) -> float:
        """A step's time with the prefix host tier's copies.

        NOTE: loads are prefetched layer by layer, as engines with a host tier do (SGLang's
        HiCache, LMCache): layer l+1's blocks cross the link while layer l computes, so only
        one layer's share of the shorter of the two stays exposed. Stores run on the copy
        engine beside the step (write-back or write-through, both asynchronous) and only
        cost time when they take longer than it."""
        if loads:
            load = self._copy_time(loads)
            compute = max(compute, load) + min(compute, load) / self.num_layers
        if stores:
            compute = max(compute, self._copy_time(stores))
        return compute

    def step_time(self, num_decodes: int, decode_context: int, chunks: list[tuple[int, int]],
                  swap_blocks: int = 0) -> float:
        """The cost model's time for a step as ``execute`` sees it: ``num_decodes``
        requests computing one token over ``decode_context`` tokens in all, ``chunks``
        (c, p) of the others in scheduling order (new requests first). Fast-forward asks
        it directly, the very same way, so a stateful cost model (``MeasuredSteps``)
        answers the same."""
        return self.cost_model.step_time(num_decodes, decode_context, chunks, swap_blocks,
                                         block_size=self.block_size)
