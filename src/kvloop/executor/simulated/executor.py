"""The simulated executor: predicts each step's time with a cost model, samples nothing.

It plays the role httpx's mock transport plays for httpx: the same contract as the real
model runner, no hardware behind it. Output lengths come from the workload (each request's
``max_tokens``), so every sampled token is a placeholder.
"""

from __future__ import annotations

from kvloop.core.interface import ModelRunnerOutput, SchedulerOutput
from kvloop.executor.simulated.cost_model import CostModel

PLACEHOLDER_TOKEN = 0
_ONE = (PLACEHOLDER_TOKEN,)


class SimulatedExecutor:
    """Executor whose step time is the cost model's prediction for the scheduled batch."""

    def __init__(self, cost_model: CostModel, block_size: int) -> None:
        self.cost_model = cost_model
        self.block_size = block_size

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        out = scheduler_output
        scheduled = out.num_scheduled_tokens
        attn_pairs = 0.0
        kv_read = 0
        for d in out.new_requests:
            c = scheduled[d.request_id]
            p = d.num_computed_tokens
            attn_pairs += c * (p + (c + 1) / 2)
            kv_read += p + c
        cached = out.cached_requests
        for rid, p in zip(cached.request_ids, cached.num_computed_tokens, strict=True):
            c = scheduled[rid]
            if c == 1:
                attn_pairs += p + 1
                kv_read += p + 1
            else:
                attn_pairs += c * (p + (c + 1) / 2)
                kv_read += p + c
        step_time = self.cost_model.step_time(
            out.total_num_scheduled_tokens,
            len(scheduled),
            attn_pairs,
            kv_read,
            len(out.blocks_to_swap_in) + len(out.blocks_to_swap_out),
            len(out.blocks_to_copy),
            self.block_size,
        )
        return ModelRunnerOutput(dict.fromkeys(scheduled, _ONE), step_time)
