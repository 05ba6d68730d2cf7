"""What the engine hands back per request: text, tokens, finish reason, timing."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(slots=True)
class RequestOutput:
    """One request's progress in one step: what the step added, and counts.

    NOTE: a step's output is a delta, so the engine's cost per request per step does not
    grow with the prompt or the output so far. The cumulative fields (``prompt_token_ids``,
    ``text``, ``token_ids``, ``logprobs``, ``metrics``) are filled only on the final output
    (``finished``) and by ``LLMEngine.snapshot``; they are None on every other output.
    """

    request_id: str
    new_token_ids: list[int]
    """Token ids sampled in this step."""
    new_text: str
    """Text added by this step (for streaming; may be empty while characters or a stop
    string are still forming)."""
    new_logprobs: list[dict[int, float]] | None
    """Per new token, token id -> log-probability of the top-n and the sampled token (None
    unless the request asked for logprobs)."""
    num_prompt_tokens: int
    num_output_tokens: int
    """Output tokens so far, this step's included."""
    finished: bool
    finish_reason: str | None = None
    """``stop``, ``length``, ``abort``, ``error`` or ``rejected`` (refused by the scheduling
    policy: an SLO it can no longer meet; ``error`` says why)."""
    error: str | None = None
    prompt: str | None = None
    """The prompt text, if it was given as text (final output only)."""
    prompt_token_ids: list[int] | None = None
    """Final output only."""
    text: str | None = None
    """The whole output text, stop strings removed (final output only)."""
    token_ids: list[int] | None = None
    """Every output token id (final output only)."""
    logprobs: list[dict[int, float]] | None = None
    """Per output token (final output only, when asked for)."""
    metrics: RequestMetrics | None = None
    """Timing of the request (final output only)."""
    index: int = 0
    """Which of the request's ``n`` sequences this is (``SamplingParams.n``)."""
    outputs: list[RequestOutput] | None = None
    """With ``n > 1``, from the offline ``LLM`` API: every sequence's final output, by
    index (this object is ``outputs[0]``'s summary: the same fields)."""
