"""The engine loop's own cost: ``LLMEngine.step`` over an executor that does nothing, so
what is timed is the scheduler and the engine's output handling (``kvloop profile`` fits
the engine overhead from it; ``benchmarks/engine_overhead.py`` prints it)."""

from __future__ import annotations

import time
from typing import Any

from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core import Scheduler
from kvloop.core.interface import ModelRunnerOutput, SchedulerOutput
from kvloop.engine.llm_engine import LLMEngine
from kvloop.executor.torch.profiler import robust_mean
from kvloop.sampling_params import SamplingParams


class NullExecutor:
    """Samples token 3 for every scheduled request, instantly."""

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput(dict.fromkeys(out.num_scheduled_tokens, (3,)), 0.0)


def engine_loop_time(batch: int, steps: int, tokenizer: Any | None, block_size: int) -> float:
    """Mean seconds of one ``LLMEngine.step`` with ``batch`` running decodes over a null
    executor: the scheduler and the engine's output handling, nothing else."""
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=max(2048, batch), max_num_seqs=batch,
                        max_model_len=4096),
        CacheConfig(block_size=block_size, num_gpu_blocks=batch * (4096 // block_size + 1)),
    )
    engine = LLMEngine(sched, NullExecutor(), tokenizer=tokenizer, vocab_size=None)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"e{i}", list(range(3, 67)), params)
    engine.step()  # the prefill step
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return robust_mean(times)
