"""From an OpenAI request body to engine input, and from engine outputs to responses.

``completion_job``/``chat_job`` parse a raw body and ``prepare_*`` check the OpenAI-only
fields, then encode and validate the request once with ``intake.validate_request`` (a bad
field is a 400 with ``param`` taken from ``InvalidRequestError.field``, before the engine
sees anything). They are pure and thread-safe: the app runs them on its prompt workers
(``prompt_workers.py``), never on the event loop. A text longer than any prompt the model
takes is refused before it is tokenized or templated. ``submit`` hands the
``ValidatedRequest`` to the engine thread; ``collect`` and ``stream`` turn its
``RequestOutput``s into one response body or into SSE chunks. Whatever ends a handler early
(client disconnect, cancellation) aborts the request in the engine.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvloop.engine.intake import (
    EncodedPrompt,
    ValidatedRequest,
    check_prompt_chars,
    check_prompt_words,
    check_tenant,
    default_max_tokens,
    encode_prompt,
    max_token_chars,
    validate_request,
)
from kvloop.errors import InvalidRequestError
from kvloop.sampling_params import SamplingParams
from kvloop.server import formatting as fmt
from kvloop.server.async_engine import (
    EngineStoppedError,
    QueueFullError,
    RequestAbortedError,
    RequestStream,
)
from kvloop.server.engine_client import EngineClient
from kvloop.server.errors import APIError, bad_request, error_body
from kvloop.server.prompt_workers import DEFAULT_WORKERS, BackgroundEncoder
from kvloop.server.protocol import ChatCompletionRequest, CompletionRequest, parse

MAX_LOGPROBS = 20


@dataclass
class Job:
    """A validated request, ready for the engine."""

    request_id: str
    chat: bool
    request: ValidatedRequest
    """What the engine runs: prompt ids, params, priority, cache salt."""
    stream: bool
    include_usage: bool
    arrival_time: float
    num_top: int | None = None
    """Top logprobs per token (None: no logprobs)."""
    continuous_usage: bool = False
    """``stream_options.continuous_usage_stats``: usage in every chunk."""
    created: int = field(default_factory=lambda: int(time.time()))


class OpenAIServing:
    """The completions and chat endpoints over one engine (``EngineClient``)."""

    def __init__(self, engine: EngineClient, model_name: str, workers: int = DEFAULT_WORKERS
                 ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.encoder = BackgroundEncoder(self.tokenizer, workers) if self.tokenizer else None
        """Encodes prompts: long ones at the lowest CPU priority (``prompt_workers.py``)."""
        self.limits = engine.limits
        """What a request must fit (the engine's, immutable)."""
        self.max_model_len = self.limits.max_model_len
        self.token_chars = max_token_chars(self.tokenizer) if self.tokenizer else None
        """The most characters one token stands for (``intake.max_token_chars``): a text
        prompt longer than ``(max_total_tokens - 1) x token_chars`` is refused before it is
        tokenized. None: no such bound (no tokenizer, or no vocabulary to read)."""

    # -- bodies (on a prompt worker) -----------------------------------------------------
    def completion_job(self, body: bytes, arrival: float) -> Job:
        """A ``/v1/completions`` body, parsed and validated (``APIError`` if bad)."""
        return self.prepare_completion(parse(CompletionRequest, body), arrival)

    def chat_job(self, body: bytes, arrival: float) -> Job:
        """A ``/v1/chat/completions`` body, parsed and validated (``APIError`` if bad)."""
        return self.prepare_chat(parse(ChatCompletionRequest, body), arrival)

    # -- validation ----------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", param="model")

    def prepare_completion(self, req: CompletionRequest, arrival: float) -> Job:
        self._common(req)
        if req.echo:
            raise bad_request("echo is not supported yet", "echo")
        if req.suffix:
            raise bad_request("suffix is not supported yet", "suffix")
        if req.best_of is not None and req.best_of < 1:
            raise bad_request(f"best_of must be >= 1, got {req.best_of}", "best_of")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise bad_request("best_of must equal n: kvloop returns every sequence it samples "
                              "(as vLLM V1)", "best_of")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise bad_request("a list of prompts is not supported yet: send one request "
                                  "per prompt", "prompt")
            prompt = prompt[0]
        num_top = _logprobs(req.logprobs, "logprobs")
        return self._job(req, prompt, req.max_tokens, "max_tokens", num_top, False, arrival)

    def prepare_chat(self, req: ChatCompletionRequest, arrival: float) -> Job:
        self._common(req)
        if req.tools:
            raise bad_request("tools are not supported yet", "tools")
        if req.tool_choice not in (None, "none"):
            raise bad_request("tool_choice is not supported yet", "tool_choice")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise bad_request("only response_format {'type': 'text'} is supported",
                              "response_format")
        if not req.messages:
            raise bad_request("messages must not be empty", "messages")
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        num_top = _logprobs(req.top_logprobs or 0, "top_logprobs") if req.logprobs else None
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):
                if any(p.type != "text" for p in content):
                    raise bad_request("only text content parts are supported", "messages")
                content = "".join(p.text or "" for p in content)
            msg: dict[str, Any] = {"role": m.role, "content": content or ""}
            if m.name is not None:
                msg["name"] = m.name
            messages.append(msg)
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer (skip_tokenizer_init): use "
                              "/v1/completions with token ids", "messages")
        try:  # NOTE: the template keeps every message's content, so the sum is a floor
            check_prompt_chars(sum(len(m["content"]) for m in messages), self.limits,
                               self.token_chars, "messages")
        except InvalidRequestError as exc:
            raise bad_request(exc.message, "messages") from None
        try:
            text = self.tokenizer.render_chat(messages, req.add_generation_prompt)
        except Exception as exc:  # no template, or the template rejected the conversation
            raise bad_request(f"cannot apply the chat template: {exc}", "messages") from None
        try:
            check_prompt_words(text, self.limits, self.encoder, "messages")
        except InvalidRequestError as exc:
            raise bad_request(exc.message, "messages") from None
        assert self.encoder is not None  # NOTE: there is a tokenizer
        # NOTE: the template writes its own special tokens (BOS included)
        ids = self.encoder.encode(text, add_special_tokens=False)
        mt, mt_name = req.max_tokens, "max_tokens"
        if req.max_tokens is not None and req.max_tokens < 1:  # NOTE: checked even if both
            raise bad_request(f"max_tokens must be at least 1, got {req.max_tokens}",
                              "max_tokens")
        if req.max_completion_tokens is not None:
            mt, mt_name = req.max_completion_tokens, "max_completion_tokens"
        return self._job(req, ids, mt, mt_name, num_top, True, arrival)

    def _common(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        self.check_model(req.model)
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options needs stream: true", "stream_options")
        if req.n is not None and req.n < 1:
            raise bad_request(f"n must be at least 1, got {req.n}", "n")
        if req.logit_bias:
            raise bad_request("logit_bias is not supported yet", "logit_bias")

    def _job(self, req: CompletionRequest | ChatCompletionRequest, prompt: Any,
             max_tokens: int | None, mt_name: str, num_top: int | None, chat: bool,
             arrival: float) -> Job:
        # NOTE: intake names its own fields; these are the OpenAI body's names for them.
        names = {"prompt": "messages" if chat else "prompt", "max_tokens": mt_name}
        try:
            enc = encode_prompt(prompt, self.limits, self.encoder,
                                token_chars=self.token_chars)
            params = self._params(req, enc, max_tokens, mt_name, num_top)
            # NOTE: the OpenAI ``user`` names the tenant; kvloop's ``tenant`` overrides it.
            tenant = req.tenant if req.tenant is not None else check_tenant(req.user, "user")
            request = validate_request(enc, params, self.limits, tokenizer=self.tokenizer,
                                       priority=req.priority, cache_salt=req.cache_salt,
                                       tenant=tenant, slo_ttft=req.slo_ttft,
                                       slo_tpot=req.slo_tpot)
        except InvalidRequestError as exc:
            field = names.get(exc.field, exc.field) if exc.field is not None else None
            raise bad_request(exc.message, field) from None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        opts = req.stream_options
        usage = bool(opts and opts.include_usage)
        return Job(rid, chat, request, req.stream, usage, arrival, num_top,
                   usage and bool(opts and opts.continuous_usage_stats))

    def _params(self, req: CompletionRequest | ChatCompletionRequest, enc: EncodedPrompt,
                max_tokens: int | None, mt_name: str, num_top: int | None) -> SamplingParams:
        """The body's sampling fields (``InvalidRequestError`` naming a bad one)."""
        d = self.engine.default_sampling
        if max_tokens is None:
            max_tokens = default_max_tokens(enc, self.limits)  # NOTE: vLLM's default
            if "max_tokens" in d:  # ... capped by the generation config's max_new_tokens
                max_tokens = min(max_tokens, d["max_tokens"])
        elif max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"{mt_name} must be at least 1, got "
                                      f"{max_tokens}")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_or(req.temperature, d.get("temperature", 1.0)),
            top_p=_or(req.top_p, d.get("top_p", 1.0)),
            top_k=_or(req.top_k, d.get("top_k", 0)),
            min_p=_or(req.min_p, d.get("min_p", 0.0)),
            seed=req.seed,
            presence_penalty=_or(req.presence_penalty, 0.0),
            frequency_penalty=_or(req.frequency_penalty, 0.0),
            repetition_penalty=_or(req.repetition_penalty, d.get("repetition_penalty", 1.0)),
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or ()),
            stop_token_ids=list(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=num_top,
            n=_or(req.n, 1),
            min_tokens=_or(req.min_tokens, 0),
        )

    # -- running -------------------------------------------------------------------------
    def submit(self, job: Job) -> RequestStream:
        try:
            return self.engine.add_request(job.request_id, job.request,
                                           arrival_time=job.arrival_time)
        except QueueFullError as exc:
            raise APIError(429, str(exc)) from None
        except EngineStoppedError as exc:
            raise APIError(503, str(exc)) from None
        except InvalidRequestError as exc:
            raise bad_request(exc.message, exc.field) from None

    def _decode(self, token_id: int) -> str:
        tok = self.tokenizer
        return tok.decode([token_id], skip_special_tokens=False) if tok else str(token_id)

    async def collect(self, job: Job, stream: RequestStream) -> dict[str, Any]:
        """Run the request to its end; the response body (``APIError`` if it failed)."""
        n = job.request.params.n
        token_ids: list[list[int]] = [[] for _ in range(n)]
        entries: list[list[dict[int, float]]] = [[] for _ in range(n)]
        finals: list[Any] = [None] * n
        try:
            async for out in stream:
                i = out.index
                if out.finished:
                    finals[i] = out
                    if out.finish_reason == "rejected":
                        break  # NOTE: refused before its sequences forked: no more outputs
                if job.num_top is not None and out.new_logprobs:
                    token_ids[i].extend(out.new_token_ids)
                    entries[i].extend(out.new_logprobs)
        except RequestAbortedError as exc:
            raise APIError(exc.status, f"request aborted: {exc}") from None
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        finally:
            stream.abort()  # NOTE: a no-op once finished; aborts on cancellation (disconnect)
        for f in finals:
            if f is not None and f.finish_reason in _FAILED:
                status, default = _FAILED[f.finish_reason]
                raise APIError(status, f.error or default)
        assert all(f is not None for f in finals), "the stream ended before every sequence"
        choices = []
        for i, f in enumerate(finals):
            lp = None
            if job.num_top is not None:
                lp = (fmt.chat_logprobs(self._decode, job.num_top, token_ids[i], entries[i])
                      if job.chat else fmt.CompletionLogprobs(self._decode, job.num_top)
                      .build(token_ids[i], entries[i]))
            choices.append(fmt.Choice(i, f.text or "", f.finish_reason, lp,
                                      None if self.tokenizer else f.token_ids))
        n_prompt = finals[0].num_prompt_tokens
        n_out = sum(f.num_output_tokens for f in finals)
        make = fmt.chat_body if job.chat else fmt.completion_body
        return make(job.request_id, job.created, self.model_name, choices, n_prompt, n_out)

    async def stream(self, job: Job, stream: RequestStream) -> AsyncIterator[str]:
        """SSE chunks of the request, then the usage chunk if asked, then ``[DONE]``."""
        rid, created, model = job.request_id, job.created, self.model_name
        n = job.request.params.n
        comp_lp = [fmt.CompletionLogprobs(self._decode, job.num_top or 0) for _ in range(n)]
        n_prompt, outs = job.request.num_prompt_tokens, [0] * n
        try:
            if job.chat:
                for i in range(n):
                    yield fmt.sse(fmt.chat_chunk(rid, created, model, {"role": "assistant",
                                                                      "content": ""},
                                                 None, None, index=i))
            async for out in stream:
                i = out.index
                outs[i] = out.num_output_tokens
                n_out = sum(outs)
                if out.finish_reason in _FAILED:
                    status, default = _FAILED[out.finish_reason]
                    yield fmt.sse(error_body(status, out.error or default))
                    break
                reason = out.finish_reason if out.finished else None
                if not out.new_token_ids and reason is None:
                    continue
                # NOTE: one chunk per step that sampled tokens, even when their text is empty
                # (a special token, a partial character, a held-back stop string), so that
                # clients time every token as vLLM's do.
                lp = None
                if job.num_top is not None:
                    lp = (fmt.chat_logprobs(self._decode, job.num_top, out.new_token_ids,
                                            out.new_logprobs or []) if job.chat else
                          comp_lp[i].build(out.new_token_ids, out.new_logprobs or []))
                ids = None if self.tokenizer else out.new_token_ids
                if job.chat:
                    delta: dict[str, Any] = (
                        {"content": out.new_text} if out.new_text or reason is None else {})
                    if ids is not None:
                        delta["token_ids"] = ids
                    chunk = fmt.chat_chunk(rid, created, model, delta, reason, lp, index=i)
                else:
                    chunk = fmt.completion_chunk(rid, created, model, out.new_text, reason, lp,
                                                 index=i, token_ids=ids)
                if job.continuous_usage:
                    chunk["usage"] = fmt.usage(n_prompt, n_out)
                yield fmt.sse(chunk)
            else:
                if job.include_usage:
                    obj = "chat.completion.chunk" if job.chat else "text_completion"
                    yield fmt.sse(fmt.usage_chunk(rid, created, model, obj, n_prompt,
                                                  sum(outs)))
        except RequestAbortedError as exc:
            yield fmt.sse(error_body(exc.status, f"request aborted: {exc}"))
        except ValueError as exc:
            yield fmt.sse(error_body(400, str(exc)))
        finally:
            stream.abort()  # NOTE: a no-op once finished; aborts when the client went away
        yield fmt.sse("[DONE]")


_FAILED = {
    "error": (500, "the model step failed"),
    "rejected": (429, "the scheduling policy rejected the request (it cannot meet its SLO)"),
}
"""Finish reasons answered with an error instead of a response: HTTP status and the message
when the output has none. A rejected request (policy ``slo``, ``--slo-overload reject``) is
a 429, so clients back off and retry as from a full queue."""


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _logprobs(value: int | None, name: str) -> int | None:
    if value is None:
        return None
    if not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}", name)
    return value
