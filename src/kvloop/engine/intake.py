"""Validate once: a request becomes a ``ValidatedRequest`` here, and nowhere else.

``validate_request`` encodes the prompt (text, token ids, or vLLM's ``{"prompt": ...}`` /
``{"prompt_token_ids": [...]}`` dicts), checks the sampling parameters, priority, cache salt,
tenant and SLO targets (``slo_ttft``/``slo_tpot``), and checks that prompt + output fit
the engine's ``EngineLimits``. Every rejection is an ``InvalidRequestError`` whose ``field``
names the bad input. Inner layers (the engine thread, the engine, the scheduler) trust the
result; the scheduler keeps one last-line check.

The functions are pure (limits and tokenizer are read-only), so the server calls them on
worker threads (``server/prompt_workers.py``) and hands the validated object to the engine
thread. A text prompt too long to possibly fit is refused before it is tokenized: by its
characters (``check_prompt_chars``, with the bound of ``max_token_chars``), and by its words
where each word is a token at least (``check_prompt_words``, reading only that many words).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict

from kvloop.errors import InvalidRequestError
from kvloop.request_fields import (
    MAX_SLO_S,
    MAX_TENANT_CHARS,
    check_cache_salt,
    check_priority,
    check_slo,
    check_tenant,
    kv_blocks_needed,
)
from kvloop.sampling_params import SamplingParams

__all__ = [
    "MAX_SLO_S",
    "MAX_TENANT_CHARS",
    "EncodedPrompt",
    "EngineLimits",
    "InvalidRequestError",
    "PromptInput",
    "TextPrompt",
    "TokensPrompt",
    "ValidatedRequest",
    "check_prompt_chars",
    "check_prompt_words",
    "check_slo",
    "check_tenant",
    "default_max_tokens",
    "encode_prompt",
    "max_prompt_chars",
    "max_token_chars",
    "validate_request",
]


class TextPrompt(TypedDict, total=False):
    """vLLM's text prompt: ``{"prompt": "..."}`` (optionally with a ``cache_salt``)."""

    prompt: str
    cache_salt: str


class TokensPrompt(TypedDict, total=False):
    """vLLM's token prompt: ``{"prompt_token_ids": [...]}`` (optionally a ``cache_salt``)."""

    prompt_token_ids: list[int]
    cache_salt: str


PromptInput = str | Sequence[int] | TextPrompt | TokensPrompt
"""A prompt as callers give it: text, token ids, or one of vLLM's prompt dicts."""


_DICT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})


class Encoder(Protocol):
    """What intake needs of a tokenizer."""

    def encode(self, prompt: str) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What every request must fit; fixed when the engine is built (safe to share)."""

    max_model_len: int
    """Longest prompt + output, in tokens."""
    kv_cache_tokens: int
    """Tokens the device KV pool holds (blocks x block size): one request must fit alone."""
    vocab_size: int | None = None
    """Prompt token ids must be in ``[0, vocab_size)``; None: not checked."""
    max_num_seqs: int | None = None
    """Most sequences running at once: ``SamplingParams.n`` may not exceed it."""
    block_size: int = 1
    """Tokens per KV block (for what ``n`` sequences sharing a prompt need)."""

    @property
    def max_total_tokens(self) -> int:
        """Longest prompt + output the engine can ever run."""
        return min(self.max_model_len, self.kv_cache_tokens)


@dataclass(frozen=True, slots=True)
class EncodedPrompt:
    """A prompt after encoding and its own checks (``encode_prompt``), before the rest."""

    prompt_token_ids: tuple[int, ...]
    """Never empty; every id is in the vocabulary."""
    prompt: str | None = None
    """The prompt text, when it was given as text."""
    cache_salt: str | None = None
    """A ``cache_salt`` given inside a prompt dict."""


@dataclass(frozen=True, slots=True)
class ValidatedRequest:
    """A request that passed ``validate_request``: what the engine queues, unchecked.

    NOTE: build it only with ``validate_request`` (or ``LLMEngine.validate``); inner layers
    trust it. ``params`` is the request's own copy, validated.
    """

    prompt_token_ids: tuple[int, ...]
    """The encoded prompt (never empty)."""
    params: SamplingParams
    """Sampling parameters; ``max_tokens`` fits the limits with the prompt."""
    prompt: str | None = None
    """The prompt text, if it was given as text (reported in the final output)."""
    priority: int = 0
    """Scheduling priority (lower runs first under the ``priority`` policy)."""
    cache_salt: str | None = None
    """Isolates this request's prefix-cache entries from other salts."""
    tenant: str = ""
    """Who sent it (the OpenAI ``user``); the ``fair`` policy shares service by it."""
    slo_ttft: float | None = None
    """TTFT target in seconds (None: the scheduler's default)."""
    slo_tpot: float | None = None
    """TPOT target in seconds (None: the scheduler's default)."""

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the encoded prompt."""
        return len(self.prompt_token_ids)


def max_token_chars(tokenizer: Any) -> int | None:
    """The most characters one token can stand for: the longest entry of the vocabulary
    (added tokens included), or None when the tokenizer does not expose one.

    NOTE: an upper bound on decoded characters per token for the tokenizers kvloop loads.
    Byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM2) writes one vocabulary character per
    byte, and a byte is at most one character; SentencePiece-style BPE (Llama 2, Mistral)
    writes ``▁`` for a space and byte-fallback tokens as ``<0x0A>`` (longer than the one
    byte they stand for). So a text of ``n`` characters is at least ``n / max_token_chars``
    tokens, unless the normalizer deletes characters (BERT-style accent stripping) or
    unknown characters fuse into one ``<unk>`` (no byte fallback): tokenizers kvloop's
    model families do not use. A fixed ratio is not safe: SmolLM2 has an 81-character token
    (a newline and 80 spaces), so "16 characters per token" would refuse valid prompts.
    """
    try:
        backend = getattr(tokenizer, "backend", None)  # NOTE: Rust, ~100x faster than hf's
        if backend is not None and hasattr(backend, "get_vocab"):
            vocab = backend.get_vocab(with_added_tokens=True)
        else:
            get_vocab = getattr(getattr(tokenizer, "hf", tokenizer), "get_vocab", None)
            if get_vocab is None:
                return None
            vocab = get_vocab()
        longest = max(map(len, vocab), default=0)
    except Exception:  # an exotic tokenizer: no bound rather than a wrong one
        return None
    return longest or None


def max_prompt_chars(limits: EngineLimits, token_chars: int | None) -> int | None:
    """Longest prompt text (characters) that can encode to fewer than
    ``limits.max_total_tokens`` tokens when no token is longer than ``token_chars``
    characters; None: no bound. A longer text is refused before it is tokenized."""
    if token_chars is None:
        return None
    return (limits.max_total_tokens - 1) * token_chars


def check_prompt_chars(num_chars: int, limits: EngineLimits, token_chars: int | None,
                       field: str = "prompt") -> None:
    """Refuse a text that must encode to more tokens than the engine takes, before any
    tokenizer work (``InvalidRequestError`` naming ``field``; see ``max_token_chars``)."""
    bound = max_prompt_chars(limits, token_chars)
    if bound is not None and token_chars is not None and num_chars > bound:
        raise InvalidRequestError(
            field, f"{field} is {num_chars} characters, so at least "
            f"{-(-num_chars // token_chars)} tokens (no token of this model is longer than "
            f"{token_chars} characters); the model takes at most "
            f"{limits.max_total_tokens - 1}")


def check_prompt_words(text: str, limits: EngineLimits, tokenizer: Any,
                       field: str = "prompt") -> None:
    """Refuse a text of more words than the engine takes prompt tokens, when each word is
    at least one token (``Tokenizer.token_floor``), before it is encoded; the check reads
    at most that many words (``InvalidRequestError`` naming ``field``)."""
    floor = getattr(tokenizer, "token_floor", None)
    if floor is None:
        return
    limit = limits.max_total_tokens - 1
    if floor(text, limit + 1) > limit:
        raise InvalidRequestError(
            field, f"{field} has more than {limit} words, so more than {limit} tokens (no "
            f"token of this model spans two words); the model takes at most {limit} "
            f"(max_model_len {limits.max_model_len}, KV cache {limits.kv_cache_tokens} tokens)")


def encode_prompt(
    prompt: PromptInput, limits: EngineLimits, tokenizer: Encoder | None = None,
    *, token_chars: int | None = None,
) -> EncodedPrompt:
    """Encode and check a prompt alone (``InvalidRequestError`` with field ``prompt``).

    ``token_chars`` (``max_token_chars(tokenizer)``): a text prompt too long to fit with
    tokens that long is refused before it is tokenized (``check_prompt_chars``)."""
    salt = None
    if isinstance(prompt, Mapping):
        prompt, salt = _unpack(prompt)
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt", "prompt must not be empty")
        check_prompt_chars(len(prompt), limits, token_chars)
        if tokenizer is None:
            raise InvalidRequestError(
                "prompt", "prompt must be token ids: this engine has no tokenizer "
                "(skip_tokenizer_init)")
        check_prompt_words(prompt, limits, tokenizer)
        ids = tuple(tokenizer.encode(prompt))
        if not ids:
            raise InvalidRequestError("prompt", "prompt must not be empty (it encodes to no "
                                      "tokens)")
        return EncodedPrompt(ids, prompt, salt)
    if isinstance(prompt, bytes | bytearray) or not isinstance(prompt, Sequence):
        raise InvalidRequestError(
            "prompt", "prompt must be text, token ids, {'prompt': str} or "
            f"{{'prompt_token_ids': [int, ...]}}, got {type(prompt).__name__}")
    ids = tuple(prompt)
    if not ids:
        raise InvalidRequestError("prompt", "prompt must not be empty")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidRequestError("prompt", "prompt_token_ids must be integers")
    vocab = limits.vocab_size
    if min(ids) < 0 or (vocab is not None and max(ids) >= vocab):
        rule = f"in [0, {vocab})" if vocab is not None else ">= 0"
        raise InvalidRequestError("prompt", f"prompt_token_ids must be {rule}")
    return EncodedPrompt(ids, None, salt)


def _unpack(prompt: Mapping[str, Any]) -> tuple[Any, str | None]:
    extra = sorted(str(k) for k in prompt if k not in _DICT_KEYS)
    if extra:
        raise InvalidRequestError("prompt", f"unsupported prompt key(s): {', '.join(extra)} "
                                  "(kvloop takes 'prompt' or 'prompt_token_ids')")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise InvalidRequestError("prompt", "a prompt dict needs exactly one of 'prompt' and "
                                  "'prompt_token_ids'")
    if "prompt" in prompt and not isinstance(prompt["prompt"], str):
        raise InvalidRequestError("prompt", "'prompt' in a prompt dict must be text; give "
                                  "token ids as 'prompt_token_ids'")
    inner = prompt.get("prompt", prompt.get("prompt_token_ids"))
    if "prompt_token_ids" in prompt and isinstance(inner, str):
        raise InvalidRequestError("prompt", "'prompt_token_ids' must be a list of integers")
    return inner, prompt.get("cache_salt")


def default_max_tokens(prompt: EncodedPrompt, limits: EngineLimits) -> int:
    """The rest of the context after ``prompt`` (vLLM's default ``max_tokens``), at least 1
    so that a prompt too long is reported as such by ``validate_request``."""
    return max(1, limits.max_total_tokens - len(prompt.prompt_token_ids))


def validate_request(
    prompt: PromptInput | EncodedPrompt,
    params: SamplingParams | None,
    limits: EngineLimits,
    *,
    tokenizer: Encoder | None = None,
    priority: int = 0,
    cache_salt: str | None = None,
    tenant: str | None = None,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
) -> ValidatedRequest:
    """The one check of a request: encode, validate, fit to ``limits``.

    ``tenant`` (None: none) is at most ``MAX_TENANT_CHARS`` characters; ``slo_ttft`` and
    ``slo_tpot`` (None: the scheduler's defaults) are positive, finite seconds.

    ``prompt`` may be already encoded by ``encode_prompt`` (the server does that first, to
    derive the default ``max_tokens``); it is not checked again. Raises
    ``InvalidRequestError`` naming the field.
    """
    enc = prompt if isinstance(prompt, EncodedPrompt) else encode_prompt(
        prompt, limits, tokenizer)
    if params is None:
        params = SamplingParams()
    elif not isinstance(params, SamplingParams):
        raise InvalidRequestError("sampling_params", "sampling_params must be SamplingParams, "
                                  f"got {type(params).__name__}")
    else:
        params = copy.copy(params)  # NOTE: the request owns what was validated
        params.stop = list(params.stop)
        params.stop_token_ids = list(params.stop_token_ids)
    params.validate()
    if params.stop and tokenizer is None:
        raise InvalidRequestError("stop", "stop strings need a tokenizer (this engine has "
                                  "none: skip_tokenizer_init); use stop_token_ids")
    priority = check_priority(priority)
    salt = check_cache_salt(cache_salt if cache_salt is not None else enc.cache_salt)
    tenant = check_tenant(tenant)
    slo_ttft = check_slo("slo_ttft", slo_ttft)
    slo_tpot = check_slo("slo_tpot", slo_tpot)
    _check_fits(len(enc.prompt_token_ids), params.max_tokens, limits)
    if params.n > 1:
        _check_group(len(enc.prompt_token_ids), params, limits)
    return ValidatedRequest(enc.prompt_token_ids, params, enc.prompt, priority, salt,
                            tenant, slo_ttft, slo_tpot)


def _check_fits(n: int, max_tokens: int, limits: EngineLimits) -> None:
    limit, max_len, kv = limits.max_total_tokens, limits.max_model_len, limits.kv_cache_tokens
    if n >= limit:
        raise InvalidRequestError(
            "prompt", f"prompt is {n} tokens, the model takes at most {limit - 1} "
            f"(max_model_len {max_len}, KV cache {kv} tokens)")
    if n + max_tokens > max_len:
        raise InvalidRequestError(
            "max_tokens", f"max_tokens {max_tokens} + prompt {n} tokens exceeds max_model_len "
            f"{max_len}")
    if n + max_tokens > kv:
        raise InvalidRequestError(
            "max_tokens", f"max_tokens {max_tokens} + prompt {n} tokens needs more KV blocks "
            f"than the cache has ({kv} tokens)")


def _check_group(n_prompt: int, params: SamplingParams, limits: EngineLimits) -> None:
    """``n`` sequences: seats for all, and KV for the shared prompt plus n tails."""
    n = params.n
    if limits.max_num_seqs is not None and n > limits.max_num_seqs:
        raise InvalidRequestError("n", f"n {n} exceeds max_num_seqs {limits.max_num_seqs}")
    blocks = kv_blocks_needed(n_prompt, params.max_tokens, n, limits.block_size)
    if blocks * limits.block_size > limits.kv_cache_tokens:
        raise InvalidRequestError(
            "n", f"{n} sequences of prompt {n_prompt} + max_tokens {params.max_tokens} tokens "
            f"need more KV blocks than the cache has ({limits.kv_cache_tokens} tokens)")
