"""THE contract between the scheduler and any executor (real model runner or simulator).

Only these plain dataclasses of ints, strings and lists cross the line. An executor keeps
its own per-request state (sampled tokens, block tables), updated from what each
``SchedulerOutput`` says changed since the previous step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvloop.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the executor has no state for: first admission, or resumed after a
    recompute preemption (then ``output_token_ids`` holds what it had generated)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    """Tokens whose KV is already in ``block_ids`` (prefix-cache hits)."""
    stop_ids: frozenset[int] = frozenset()
    """Token ids that end the request (EOS unless ignored, ``stop_token_ids``): sampling
    masks them until ``sampling_params.min_tokens`` tokens are out."""


@dataclass
class CachedRequestData:
    """Requests the executor already knows, as parallel lists (one entry per request)."""

    request_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    """Blocks appended to the request's table this step (the whole table if swapped in)."""
    num_computed_tokens: list[int] = field(default_factory=list)
    resumed_from_swap: list[bool] = field(default_factory=list)
    """True: the request was swapped back in and ``new_block_ids`` replaces its table."""

    def __len__(self) -> int:
        return len(self.request_ids)


@dataclass
class SchedulerOutput:
    """What to run in one step.

    NOTE: executors apply, in this order: forget ``finished_request_ids`` and the
    recompute-preempted ids in ``preempted_request_ids``, ``blocks_to_swap_out`` and
    ``blocks_to_offload`` (device -> host), ``blocks_to_swap_in`` and ``blocks_to_load``
    (host -> device), ``blocks_to_copy``, then the forward pass. A step never has both
    swap-ins and swap-outs, so the two copy lists never touch the same blocks; the prefix
    host tier pins the host blocks its transfers touch (``kvloop.core.host_tier``).
    """

    step: int
    new_requests: list[NewRequestData]
    cached_requests: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    """Tokens to compute per request this step (1 for a decode, the chunk for a prefill)."""
    total_num_scheduled_tokens: int
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    """(device block, host block) pairs to copy device -> host."""
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    """(host block, device block) pairs to copy host -> device."""
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    """(source, destination) device blocks to duplicate: the partial last prompt block of
    a sequence group, copied for each sibling forked from it (copy on write)."""
    blocks_to_offload: list[tuple[int, int]] = field(default_factory=list)
    """(device block, host block) pairs to copy device -> host: prefix blocks stored in the
    prefix cache's host tier."""
    blocks_to_load: list[tuple[int, int]] = field(default_factory=list)
    """(host block, device block) pairs to copy host -> device: prefix hits in the host
    tier loaded back instead of recomputed."""
    kv_load_choices: list[tuple[str, str, int]] = field(default_factory=list)
    """(request_id, ``load`` or ``recompute``, host blocks) for admissions whose prefix
    continued in the host tier: what the scheduler chose (executors ignore it)."""
    finished_request_ids: list[str] = field(default_factory=list)
    """Requests finished or aborted since the previous step: drop their state."""
    preempted_request_ids: list[str] = field(default_factory=list)
    """Requests preempted this step (recomputed ones come back as new requests)."""
    swapped_out_request_ids: list[str] = field(default_factory=list)
    """The subset of ``preempted_request_ids`` that was swapped (keep their state)."""

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """What one step produced."""

    sampled_token_ids: dict[str, Sequence[int]]
    """Tokens sampled per scheduled request. Entries for requests still in the middle of
    their prefill are allowed and ignored by the scheduler."""
    step_time_s: float
    """Measured (real runner) or predicted (simulator) duration of the step."""
    logprobs: dict[str, list[dict[int, float]]] | None = None
    """Per request, per sampled token, the top-n token -> log-probability (if asked)."""
    errors: dict[str, str] | None = None
    """Requests of the step that should have sampled and could not, with the reason (e.g.
    NaN logits): each fails alone, the rest of the step goes on."""


class Executor(Protocol):
    """Runs scheduled steps. The real model runner and the simulator both implement it."""

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...
