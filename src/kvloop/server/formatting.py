"""Response bodies of the OpenAI API: completion and chat objects, stream chunks, logprobs."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Decode = Callable[[int], str]


def sse(obj: dict[str, Any] | str) -> str:
    """One server-sent event (``data: ...`` and a blank line)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False,
                                                       separators=(",", ":"))
    return f"data: {data}\n\n"


def usage(num_prompt: int, num_completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
    }


def _top(entries: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(entries.items(), key=lambda kv: -kv[1])[:n]


class CompletionLogprobs:
    """Completions-format logprobs (``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset``), built token by token across stream chunks."""

    def __init__(self, decode: Decode, num_top: int) -> None:
        self.decode = decode
        self.num_top = num_top
        self.offset = 0

    def build(self, token_ids: list[int], entries: list[dict[int, float]]) -> dict[str, Any]:
        tokens, logprobs, tops, offsets = [], [], [], []
        for tid, d in zip(token_ids, entries, strict=False):
            text = self.decode(tid)
            tokens.append(text)
            logprobs.append(d.get(tid))
            top = dict(_top(d, self.num_top))
            if tid in d:  # the sampled token is always listed, as vLLM and OpenAI do
                top.setdefault(tid, d[tid])
            tops.append({self.decode(k): v for k, v in top.items()} if self.num_top else None)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops,
                "text_offset": offsets}


def chat_logprobs(decode: Decode, num_top: int, token_ids: list[int],
                  entries: list[dict[int, float]]) -> dict[str, Any]:
    """Chat-format logprobs: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def item(tid: int, lp: float | None) -> dict[str, Any]:
        text = decode(tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = []
    for tid, d in zip(token_ids, entries, strict=False):
        entry = item(tid, d.get(tid))
        entry["top_logprobs"] = [item(k, v) for k, v in _top(d, num_top)]
        content.append(entry)
    return {"content": content}


@dataclass(frozen=True)
class Choice:
    """One sequence's part of a whole (non-streamed) response."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None
    token_ids: list[int] | None = None
    """Output token ids, returned when the server has no tokenizer (its text is empty)."""


def completion_body(rid: str, created: int, model: str, choices: list[Choice],
                    num_prompt: int, num_completion: int) -> dict[str, Any]:
    """A whole completion: every sequence's choice, plus usage (all sequences' tokens)."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [_with_ids({"index": c.index, "text": c.text, "logprobs": c.logprobs,
                               "finish_reason": c.finish_reason, "stop_reason": None},
                              c.token_ids) for c in choices],
        "usage": usage(num_prompt, num_completion),
    }


def completion_chunk(rid: str, created: int, model: str, text: str,
                     finish_reason: str | None, logprobs: dict[str, Any] | None,
                     *, index: int = 0, token_ids: list[int] | None = None
                     ) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [_with_ids({"index": index, "text": text, "logprobs": logprobs,
                               "finish_reason": finish_reason, "stop_reason": None},
                              token_ids)],
    }


def chat_body(rid: str, created: int, model: str, choices: list[Choice],
              num_prompt: int, num_completion: int) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [_with_ids({"index": c.index,
                               "message": {"role": "assistant", "content": c.text},
                               "logprobs": c.logprobs, "finish_reason": c.finish_reason},
                              c.token_ids) for c in choices],
        "usage": usage(num_prompt, num_completion),
    }


def chat_chunk(rid: str, created: int, model: str, delta: dict[str, Any],
               finish_reason: str | None, logprobs: dict[str, Any] | None,
               *, index: int = 0) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                     "finish_reason": finish_reason}],
    }


def _with_ids(choice: dict[str, Any], token_ids: list[int] | None) -> dict[str, Any]:
    # NOTE: as vLLM's ``return_token_ids``: a server without a tokenizer returns ids.
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def usage_chunk(rid: str, created: int, model: str, obj: str, num_prompt: int,
                 num_completion: int) -> dict[str, Any]:
    """The final chunk of ``stream_options.include_usage``: no choices, the usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(num_prompt, num_completion)}
