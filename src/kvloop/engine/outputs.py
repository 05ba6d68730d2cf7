"""What the engine hands back per request: text, tokens, finish reason, timing."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvloop.core.request import Request


@dataclass
class RequestMetrics:
    """Per-request timing in seconds (ARCHITECTURE.md's metric definitions)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    queue_time: float | None
    """Arrival to first scheduled."""
    ttft: float | None
    """Arrival to first output token."""
    tpot: float | None
    """(e2e − TTFT) / (output tokens − 1); None with fewer than two tokens."""
    e2e: float | None
    """Arrival to last token."""
    num_preemptions: int = 0

    @classmethod
    def of(cls, r: Request) -> RequestMetrics:
        a = r.arrival_time
        ttft = r.first_token_time - a if r.first_token_time is not None else None
        last = r.token_times[-1] if r.token_times else None
        e2e = last - a if last is not None else None
        n = len(r.token_times)
        tpot = (e2e - ttft) / (n - 1) if ttft is not None and e2e is not None and n > 1 else None
        queue = r.first_scheduled_time - a if r.first_scheduled_time is not None else None
        return cls(
            a,
            r.first_scheduled_time,
            r.first_token_time,
            r.finished_time,
            queue,
            ttft,
            tpot,
            e2e,
            r.num_preemptions,
        )


@dataclass
class RequestOutput:
    """The state of one request after a step (cumulative, plus what this step added)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    """Output text so far (stop strings removed)."""
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    """``stop``, ``length``, ``abort`` or ``error``."""
    new_text: str = ""
    """Text added by this step (for streaming)."""
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    """Per output token, token id -> log-probability of the top-n and the sampled token."""
    error: str | None = None
    metrics: RequestMetrics | None = None
