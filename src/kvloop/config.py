"""Engine configuration: frozen dataclasses whose fields carry vLLM's knob names.

Config is passed in explicitly; nothing here reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PreemptionMode = Literal["recompute", "swap"]
SchedulingPolicy = Literal["fcfs", "priority", "slo", "fair", "sjf", "mlfq", "balanced"]
LengthPredictorName = Literal["oracle", "noisy", "history"]
SloOverload = Literal["defer", "reject"]
SchedulingOrder = Literal["decode-first", "prefill-first"]
OffloadWritePolicy = Literal["write_back", "write_through"]
OffloadLoad = Literal["auto", "load", "recompute"]
KVEviction = Literal["lru", "queue-aware"]


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
    """Waiting-queue order (``kvloop.core.policies``): ``fcfs`` (arrival); ``priority``
    (lower value first, aged by ``aging_s``; a waiting request may preempt less urgent
    running ones); ``slo`` (earliest TTFT deadline first, prefill capped so running
    decodes keep their TPOT, late requests deferred or rejected); ``fair`` (per-tenant
    fair share, the Virtual Token Counter); ``sjf`` (shortest predicted work first, aged
    by ``aging_s``); ``mlfq`` (skip-join multi-level feedback queue, aged by ``aging_s``);
    ``balanced`` (``slo``'s deadlines, ordered by predicted length among near deadlines,
    within ``fair``'s shares)."""
    slo_ttft: float | None = None
    """Default TTFT target in seconds (requests may carry their own). Required by ``slo``."""
    slo_tpot: float | None = None
    """Default TPOT target in seconds (requests may carry their own; None: no TPOT cap)."""
    slo_overload: SloOverload = "defer"
    """Under ``slo``, a waiting request that can no longer meet its TTFT target is
    ``defer``-red behind every request that still can, or ``reject``-ed at once (finish
    reason ``rejected``; HTTP 429 in the server)."""
    aging_s: float = 60.0
    """Starvation bound. Under ``priority`` a request gains one priority level per
    ``aging_s`` seconds of waiting; under ``slo`` a deferred request is served ahead of
    on-time ones once it is ``aging_s`` past its deadline. 0 turns aging off (``priority``
    only: a strict priority order, as in vLLM)."""
    tenant_weights: tuple[tuple[str, float], ...] = ()
    """Under ``fair``: ``(tenant, weight)`` pairs; a tenant's share of service is
    proportional to its weight (default 1)."""
    length_predictor: LengthPredictorName = "history"
    """Where ``sjf`` and ``balanced`` get output lengths (``kvloop.core.policies.predict``):
    ``oracle`` (``max_tokens``: the true length in the simulator), ``noisy`` (the oracle
    with noise for Kendall's tau ``predictor_tau``) or ``history`` (learned from finished
    requests by tenant and prompt length; usable in the engine)."""
    predictor_tau: float = 0.5
    """Kendall's tau the ``noisy`` predictor aims at, in [0, 1]."""
    cost_aware_preemption: bool = True
    """Save the work preemption throws away (``kvloop.core.preemption``): admission keeps
    free blocks for the running requests' unfinished prompts and their next 64 tokens each,
    and admits a prompt only if all of it fits beside them; a request waits a step when
    one finishing in it frees the blocks it lacks; victims preempted ``max_preemptions``
    times or freeing no block are spared; at most one step's budget of work is thrown
    away per step. False: vLLM's rules (admit while blocks are free, newest victim)."""
    max_preemptions: int = 3
    """Under cost-aware preemption, a request preempted this many times is not chosen as
    a victim again while another candidate exists."""
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
        _choice("policy", self.policy,
                ("fcfs", "priority", "slo", "fair", "sjf", "mlfq", "balanced"))
        _choice("length_predictor", self.length_predictor, ("oracle", "noisy", "history"))
        if not (isinstance(self.predictor_tau, (int, float)) and 0 <= self.predictor_tau <= 1):
            raise ValueError(
                f"predictor_tau must be a number in [0, 1], got {self.predictor_tau!r}")
        _choice("slo_overload", self.slo_overload, ("defer", "reject"))
        _positive("max_preemptions", self.max_preemptions)
        for name in ("slo_ttft", "slo_tpot"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and 0 < value < 1e9):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.policy in ("slo", "balanced") and self.slo_ttft is None:
            raise ValueError(f"policy {self.policy!r} needs a default TTFT target: set "
                             "slo_ttft (--slo-ttft)")
        if not (isinstance(self.aging_s, (int, float)) and 0 <= self.aging_s < 1e9):
            raise ValueError(
                f"aging_s (--aging) must be a number of seconds >= 0, got {self.aging_s!r}")
        if self.policy in ("slo", "balanced") and self.aging_s <= 0:
            raise ValueError(f"policy {self.policy!r} needs aging_s (--aging) > 0 (the "
                             "starvation bound)")
        for item in self.tenant_weights:
            if (not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str)
                    or not isinstance(item[1], (int, float)) or not 0 < item[1] < 1e9):
                raise ValueError(
                    f"tenant_weights must be (tenant, positive weight) pairs, got {item!r}")
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
    kv_offload_blocks: int = 0
    """Host blocks of the prefix cache's second tier (``--kv-offload-space``; 0: none).
    Blocks leaving the device prefix cache are kept there, found by the same hash, and
    loaded back on a hit. Swap preemption may also use them (it reclaims the tier's least
    recently used blocks when its own ``num_cpu_blocks`` run out)."""
    kv_offload_write_policy: OffloadWritePolicy = "write_back"
    """``write_back``: copy a block to the host tier when the device evicts it;
    ``write_through``: as soon as it is cached on the device (more copies, none lost)."""
    kv_offload_load: OffloadLoad = "auto"
    """Host hits are ``load``-ed, ``recompute``-d, or (``auto``) whichever the costs below
    make cheaper, per request."""
    kv_load_s_per_block: float = 0.0
    """Seconds to copy one block host -> device (the executor's link; 0: free)."""
    kv_load_latency_s: float = 0.0
    """Fixed seconds a request's load costs beyond its blocks."""
    kv_recompute_s_per_token: float = 0.0
    """Seconds prefill spends per prompt token (0: unknown, so ``auto`` loads)."""
    kv_eviction: KVEviction = "lru"
    """Which free cached block the device evicts first: ``lru``, or ``queue-aware`` (LRU,
    passing over blocks the first ``kv_eviction_lookahead`` waiting requests would hit)."""
    kv_eviction_lookahead: int = 16
    """Waiting requests whose prefixes queue-aware eviction protects (bounded work)."""

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("num_gpu_blocks", self.num_gpu_blocks)
        if self.num_cpu_blocks < 0:
            raise ValueError("num_cpu_blocks must be >= 0")
        if (not isinstance(self.kv_offload_blocks, int) or isinstance(self.kv_offload_blocks, bool)
                or self.kv_offload_blocks < 0):
            raise ValueError(
                f"kv_offload_blocks must be an integer >= 0, got {self.kv_offload_blocks!r}")
        _choice("kv_offload_write_policy", self.kv_offload_write_policy,
                ("write_back", "write_through"))
        _choice("kv_offload_load", self.kv_offload_load, ("auto", "load", "recompute"))
        for name in ("kv_load_s_per_block", "kv_load_latency_s", "kv_recompute_s_per_token"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < 1e9):
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
        _choice("kv_eviction", self.kv_eviction, ("lru", "queue-aware"))
        _positive("kv_eviction_lookahead", self.kv_eviction_lookahead)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
