"""A request as the scheduler sees it: tokens, progress, status and timestamps."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvloop.core.prefix_hash import HashMemo, block_hash, chain_hashes, root_hash, token_bytes
from kvloop.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvloop.core.group import SequenceGroup


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Values >= FINISHED_STOPPED are terminal."""

    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    PREEMPTED = 3  # back in the waiting queue after a recompute preemption
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7
    FINISHED_REJECTED = 8  # refused by the policy (an SLO it can no longer meet)

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(enum.StrEnum):
    """Why a request finished, named as the OpenAI API names it."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    REJECTED = "rejected"


_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    RequestStatus.FINISHED_REJECTED: FinishReason.REJECTED,
}


class Request:
    """One generation request.

    ``prompt_token_ids`` may be any sequence of ints (a list, a ``range``, an ``array``),
    so simulated workloads need not materialise millions of ids.
    """

    __slots__ = (
        "arrival_order",
        "arrival_time",
        "block_hashes",
        "cache_salt",
        "eos_token_ids",
        "error",
        "finished_time",
        "first_scheduled_time",
        "first_token_time",
        "group",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "num_recomputed_tokens",
        "num_served_tokens",
        "output_token_ids",
        "priority",
        "prompt_token_ids",
        "request_id",
        "sample_index",
        "sampling_params",
        "slo_tpot",
        "slo_ttft",
        "status",
        "stop_ids",
        "tenant",
        "token_times",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        arrival_time: float = 0.0,
        priority: int = 0,
        cache_salt: str | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        tenant: str = "",
        slo_ttft: float | None = None,
        slo_tpot: float | None = None,
    ) -> None:
        # NOTE: a request reaches the core checked: the engine's gate
        # (``engine.intake.validate_request``, and ``LLMEngine.add_request`` for the id)
        # refuses bad fields with an error naming them; the simulator builds its requests
        # from workloads it parsed. The core asserts only what its bookkeeping relies on.
        assert isinstance(request_id, str) and request_id, "request_id: a non-empty string"
        assert len(prompt_token_ids) > 0, "prompt_token_ids: not empty"
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params or SamplingParams()
        self.arrival_time = arrival_time
        self.arrival_order = 0
        """Tie-breaker among equal arrival times, set by the scheduler on admission."""
        self.priority = priority
        self.cache_salt = cache_salt
        self.tenant = tenant
        """Who sent it (the OpenAI ``user``); the ``fair`` policy shares service by it."""
        self.slo_ttft = slo_ttft
        """TTFT target in seconds (None: the scheduler's default ``slo_ttft``)."""
        self.slo_tpot = slo_tpot
        """TPOT target in seconds (None: the scheduler's default ``slo_tpot``)."""
        self.eos_token_ids = eos_token_ids
        self.stop_ids: frozenset[int] = frozenset()
        """Token ids that stop this request (EOS unless ignored, plus stop_token_ids); the
        scheduler sets it when the request is added."""
        """The model's end-of-sequence ids: each stops the request unless ``ignore_eos``."""
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.output_token_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.token_times: list[float] = []
        self.finished_time: float | None = None
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.num_served_tokens = 0
        """The most tokens ever computed for it (a high-water mark of
        ``num_computed_tokens``): the ``fair`` policy charges only tokens past it, so a
        recompute is not charged twice (kept by that policy only)."""
        self.error: str | None = None
        self.group: SequenceGroup | None = None
        """Set when ``sampling_params.n > 1``: the sequences sampled from this prompt."""
        self.sample_index = 0
        """Which of the group's sequences this is (0: the leader)."""

    # -- sizes ---------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens known so far (all of them need KV once computed)."""
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def prefill_end(self) -> int:
        """Computed tokens at which the prompt (or a recompute) is done and the request
        decodes: all of its tokens but the last sampled one, which its next decode computes
        (the whole prompt before any output)."""
        return self.num_prompt_tokens + len(self.output_token_ids) - (
            1 if self.output_token_ids else 0)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def max_total_tokens(self) -> int:
        """Tokens the request may reach: prompt + max_tokens."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _REASONS.get(self.status)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids in ``[start, end)`` over prompt then output, without concatenating."""
        n = self.num_prompt_tokens
        if end <= n:
            return list(self.prompt_token_ids[start:end])
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return list(self.prompt_token_ids[start:]) + self.output_token_ids[: end - n]

    def all_token_ids(self) -> list[int]:
        return self.token_ids(0, self.num_tokens)

    # -- prefix-cache hashes -------------------------------------------------------
    def update_block_hashes(self, block_size: int, memo: HashMemo | None = None
                            ) -> list[bytes]:
        """Extend ``block_hashes`` over every full block of known tokens and return it
        (``kvloop.core.prefix_hash``: SHA-256 chained over the blocks, salted; ``memo``
        may know some)."""
        hashes = self.block_hashes
        num_prompt = self.num_prompt_tokens
        num_full = (num_prompt + len(self.output_token_ids)) // block_size
        done = len(hashes)
        if done < num_full:
            start, end = done * block_size, num_full * block_size
            if not done and memo is not None and num_prompt >= block_size:
                hashes.extend(memo.prompt(self.cache_salt, self.prompt_token_ids, block_size))
                return self.update_block_hashes(block_size, memo)
            if done and done + 1 == num_full and start >= num_prompt:
                # NOTE: the common case, one block of outputs (``chain_hashes``' step)
                outputs = self.output_token_ids[start - num_prompt:end - num_prompt]
                hashes.append(block_hash(hashes[-1], outputs) if memo is None
                              else memo.block(hashes[-1], outputs))
            else:
                parent = hashes[-1] if hashes else root_hash(self.cache_salt)
                data = token_bytes(self.token_ids(start, end))
                hashes.extend(chain_hashes(parent, data, block_size, num_full - done))
        return hashes

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens}, "
            f"out={self.num_output_tokens}/{self.max_tokens})"
        )
