"""Request bodies of the OpenAI API, as strict pydantic models.

Strict JSON validation: a field of the wrong type (``"max_tokens": "5"``, ``"n": true``), an
unknown field or malformed JSON is a 400 naming it; ranges are checked when the request
becomes ``SamplingParams``. Fields kvloop accepts but cannot honour yet (``n > 1``, ``echo``,
``best_of``, ``logit_bias``, tools) are declared so that the 400 says exactly that.
Extras beyond OpenAI's fields follow vLLM: ``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``stop_token_ids``, ``priority``, ``cache_salt``.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from kvloop.server.errors import from_validation_error

M = TypeVar("M", bound=BaseModel)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a final chunk with the token counts."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Strict):
    """Fields shared by completions and chat."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = 0
    cache_salt: str | None = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Strict):
    """A content part of a chat message; only ``text`` parts are supported."""

    type: str
    text: str | None = None
    image_url: dict[str, Any] | None = None


class ChatMessage(BaseModel):
    """One message of a conversation (other fields, e.g. ``tool_calls``, are ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True


def parse(model: type[M], body: bytes) -> M:
    """Validate a raw JSON body (strict); any problem raises a 400 ``APIError``."""
    try:
        return model.model_validate_json(body or b"")
    except ValidationError as exc:
        raise from_validation_error(exc) from None
