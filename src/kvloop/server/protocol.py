"""Request bodies of the OpenAI API, as strict pydantic models.

Strict JSON validation: a field of the wrong type (``"max_tokens": "5"``, ``"n": true``), an
unknown field or malformed JSON is a 400 naming it; ranges are checked when the request
becomes ``SamplingParams``. Fields kvloop accepts but cannot honour yet (``n > 1``, ``echo``,
``best_of``, ``logit_bias``, tools) are declared so that the 400 says exactly that.
Extras beyond OpenAI's fields follow vLLM: ``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``stop_token_ids``, ``priority``, ``cache_salt``; and kvloop's own for the
scheduling policies: ``tenant`` (overrides ``user``, which names the tenant otherwise),
``slo_ttft`` and ``slo_tpot`` (seconds).

The JSON schemas (``/openapi.json``) state the ranges and restrictions that the server checks
(``_doc``), so that clients and fuzzers know what is valid; validation itself is unchanged,
with its own messages naming the field.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvloop.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MIN_REPETITION_PENALTY,
)
from kvloop.server.errors import from_validation_error

M = TypeVar("M", bound=BaseModel)


def _doc(default: Any = None, **schema: Any) -> Any:
    """A field whose JSON schema also says ``schema`` (documentation only: not enforced by
    pydantic). Keywords at the field's level apply to the matching JSON types only
    (``minimum`` to numbers, ``minItems`` to arrays), so ``X | None`` keeps its null."""
    return Field(default, json_schema_extra=schema)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a final chunk with the token counts."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Strict):
    """Fields shared by completions and chat."""

    model: str | None = None
    max_tokens: int | None = _doc(minimum=1)
    temperature: float | None = _doc(minimum=0, description="Below 1e-5: greedy.")
    top_p: float | None = _doc(exclusiveMinimum=0, maximum=1)
    n: int | None = _doc(minimum=1, description="Sequences sampled from the prompt (at most "
                         "the server's max_num_seqs); they share its KV blocks.")
    min_tokens: int | None = _doc(minimum=0, description="vLLM's: EOS and stop_token_ids "
                                  "cannot end the output before this many tokens.")
    stream: bool = False
    stream_options: StreamOptions | None = _doc(description="Needs `stream: true`.")
    stop: str | list[str] | None = _doc(minLength=1, maxItems=MAX_STOP_STRINGS,
                                        items={"minLength": 1})
    seed: int | None = _doc(minimum=INT64_MIN, maximum=INT64_MAX)
    presence_penalty: float | None = _doc(minimum=-2, maximum=2)
    frequency_penalty: float | None = _doc(minimum=-2, maximum=2)
    logit_bias: dict[str, float] | None = _doc(maxProperties=0,
                                               description="Not supported (empty only).")
    user: str | None = _doc(maxLength=256, description="Names the tenant (the `fair` "
                            "scheduling policy shares service by it) unless `tenant` is given.")
    # vLLM's extras
    top_k: int | None = _doc(minimum=-1, description="0 or -1: all tokens.")
    min_p: float | None = _doc(minimum=0, maximum=1)
    repetition_penalty: float | None = _doc(minimum=MIN_REPETITION_PENALTY)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = _doc(maxItems=MAX_STOP_TOKEN_IDS,
                                            items={"minimum": 0, "maximum": INT64_MAX})
    priority: int = _doc(0, minimum=INT64_MIN, maximum=INT64_MAX,
                         description="Lower runs first under `--scheduling-policy priority`.")
    cache_salt: str | None = _doc(minLength=1)
    # kvloop's scheduling extras
    tenant: str | None = _doc(maxLength=256, description="The tenant, overriding `user`.")
    slo_ttft: float | None = _doc(exclusiveMinimum=0, description="Time-to-first-token "
                                  "target in seconds (default: the server's --slo-ttft).")
    slo_tpot: float | None = _doc(exclusiveMinimum=0, description="Time-per-output-token "
                                  "target in seconds (default: the server's --slo-tpot).")


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]] = _doc(
        ..., minLength=1, minItems=1, items={"minimum": 0, "minLength": 1, "minItems": 1},
        description="Text, token ids, or a one-item list of either (one prompt per request).")
    logprobs: int | None = _doc(minimum=0, maximum=20)
    echo: bool = _doc(False, const=False, description="Not supported.")
    suffix: str | None = _doc(maxLength=0, description="Not supported.")
    best_of: int | None = _doc(minimum=1, description="Only equal to n (as vLLM V1): "
                               "kvloop returns every sequence it samples.")


class TextPart(_Strict):
    """A content part of a chat message; only ``text`` parts are supported."""

    type: str = _doc(..., const="text", description="Only text parts are supported.")
    text: str | None = None
    image_url: dict[str, Any] | None = None


class ChatMessage(BaseModel):
    """One message of a conversation (other fields, e.g. ``tool_calls``, are ignored); its
    role is one of OpenAI's (the chat template renders each as it is named)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = _doc(..., minItems=1)
    max_completion_tokens: int | None = _doc(minimum=1)
    logprobs: bool = False
    top_logprobs: int | None = _doc(minimum=0, maximum=20, description="Needs `logprobs: true`.")
    response_format: dict[str, Any] | None = _doc(
        properties={"type": {"const": "text"}}, description="Only `{\"type\": \"text\"}`.")
    tools: list[dict[str, Any]] | None = _doc(maxItems=0, description="Not supported.")
    tool_choice: str | dict[str, Any] | None = _doc(enum=["none", None],
                                                    description="Only `none`.")
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True


def parse(model: type[M], body: bytes) -> M:
    """Validate a raw JSON body (strict); any problem raises a 400 ``APIError``."""
    try:
        return model.model_validate_json(body or b"")
    except ValidationError as exc:
        raise from_validation_error(exc) from None
