"""Engine configuration: frozen dataclasses whose fields carry vLLM's knob names.

Config is passed in explicitly; nothing here reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PreemptionMode = Literal["recompute", "swap"]
SchedulingPolicy = Literal["fcfs", "priority"]
SchedulingOrder = Literal["decode-first", "prefill-first"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits and rules the scheduler applies before every step."""

    max_num_batched_tokens: int = 8192
    """Token budget of one step: decodes count 1 each, prefill chunks their length."""
    max_num_seqs: int = 256
    """Most requests that may be running (holding KV blocks on the device) at once."""
    max_model_len: int = 8192
    """Longest prompt + output a request may reach; longer requests fail at once."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the remaining budget into chunks over several steps."""
    long_prefill_token_threshold: int = 0
    """A prompt chunk is capped at this many tokens per step (0: no cap). When 0 and
    ``max_num_partial_prefills > 1`` the cap defaults to 4% of ``max_model_len``, as in vLLM."""
    max_num_partial_prefills: int = 1
    """Most requests whose prefill may be unfinished at once. A new prompt that cannot
    finish its prefill within the step is held back while this many are in flight, but a
    prompt that does fit is still admitted, so one long prompt never blocks short ones."""
    policy: SchedulingPolicy = "fcfs"
    """Waiting-queue order: ``fcfs`` (arrival) or ``priority`` (lower value first, then
    arrival). Under ``priority`` a waiting request may preempt less urgent running ones."""
    preemption_mode: PreemptionMode = "recompute"
    """How a victim gives up its KV blocks: ``recompute`` (free them, prefill again later)
    or ``swap`` (copy them to the host tier; falls back to recompute when it is full)."""
    scheduling_order: SchedulingOrder = "decode-first"
    """``decode-first`` serves running requests before admitting prompts (steady ITL);
    ``prefill-first`` admits waiting prompts first (lower TTFT, ITL spikes)."""

    def __post_init__(self) -> None:
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_model_len", self.max_model_len)
        _positive("max_num_partial_prefills", self.max_num_partial_prefills)
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        _choice("policy", self.policy, ("fcfs", "priority"))
        _choice("preemption_mode", self.preemption_mode, ("recompute", "swap"))
        _choice("scheduling_order", self.scheduling_order, ("decode-first", "prefill-first"))
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # NOTE: without chunking a whole prompt must fit one step's budget.
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len when enable_chunked_prefill "
                f"is off ({self.max_num_batched_tokens} < {self.max_model_len})"
            )

    @property
    def prefill_chunk_cap(self) -> int:
        """Largest prompt chunk one request may take in a step (0: none beyond the budget)."""
        if self.long_prefill_token_threshold > 0:
            return self.long_prefill_token_threshold
        if self.max_num_partial_prefills > 1:
            return max(1, int(self.max_model_len * 0.04))
        return 0


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block geometry, pool sizes and prefix caching."""

    block_size: int = 16
    """Tokens per KV block."""
    num_gpu_blocks: int = 4096
    """Blocks in the device pool (derived from memory by the executors' helpers)."""
    num_cpu_blocks: int = 0
    """Blocks in the host tier used by swap preemption (0: swap falls back to recompute)."""
    enable_prefix_caching: bool = True
    """Share full blocks between requests with equal prefixes (chained block hashes)."""

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("num_gpu_blocks", self.num_gpu_blocks)
        if self.num_cpu_blocks < 0:
            raise ValueError("num_cpu_blocks must be >= 0")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
