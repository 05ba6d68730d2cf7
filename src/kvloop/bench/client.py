"""A streaming OpenAI-API client that times every chunk: one request, one :class:`RequestRecord`.

Only standard OpenAI streaming fields are read, so any compatible server works (kvloop, vLLM,
llama.cpp, transformers): ``choices[0].text`` (completions) or ``choices[0].delta.content``
(chat) marks an output chunk, the final ``usage`` gives the token counts (when a server sends
none, the output chunks are counted instead), ``error`` objects and non-200 answers become the
request's error message.

A chunk counts as output when its text is non-empty, or empty without a finish reason (a
server that streams one chunk per token may send empty text for a special token or a partial
character). A chat chunk that only carries the role, and a last chunk with only the finish
reason, are not output. httpx is imported only when a request is sent.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

__all__ = ["RequestRecord", "error_message", "fetch_models", "normalize_base_url", "send"]

MAX_ERROR_CHARS = 300


@dataclass
class RequestRecord:
    """One benchmark request, duck-typed for :func:`kvloop.sim.metrics.summarize_requests`.

    Times are seconds on the benchmark clock (``time.perf_counter()`` minus its start).
    """

    request_id: str
    scheduled_time: float
    """When the arrival process released the request."""
    num_prompt_tokens: int
    """From the server's usage; the client-side count until then."""
    expected_output_tokens: int
    arrival_time: float = 0.0
    """When the request was sent (after waiting for a concurrency slot)."""
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    """Arrival time of every output chunk."""
    finished_time: float | None = None
    num_output_tokens: int = 0
    status: str = "WAITING"
    """``FINISHED_STOPPED``/``FINISHED_LENGTH`` when completed, ``FINISHED_ERROR`` if failed."""
    error: str | None = None
    first_scheduled_time: float | None = None
    """Unknown to a client; always None (no queue-time metric)."""
    tenant: str = ""
    """Sent as the OpenAI ``user`` field (``--tenant-mix``)."""

    @property
    def output_token_ids(self) -> range:
        """Stand-in of the right length: the client sees text, not ids."""
        return range(self.num_output_tokens)

    def fail(self, message: str, now: float) -> None:
        self.status, self.error, self.finished_time = "FINISHED_ERROR", message, now

    def row(self) -> dict[str, Any]:
        """The per-request row of the JSON report (seconds; None where not defined)."""
        ok = self.status != "FINISHED_ERROR"
        first = self.first_token_time
        last = self.token_times[-1] if self.token_times else self.finished_time
        ttft = first - self.arrival_time if ok and first is not None else None
        e2e = last - self.arrival_time if ok and last is not None else None
        n = self.num_output_tokens
        tpot = (e2e - ttft) / (n - 1) if ttft is not None and e2e is not None and n > 1 else None
        times = self.token_times
        return {
            "request_id": self.request_id,
            "arrival_offset": self.scheduled_time,
            "send_offset": self.arrival_time,
            "status": self.status,
            "tenant": self.tenant,
            "ttft": ttft,
            "tpot": tpot,
            "e2e": e2e,
            "itl": [b - a for a, b in itertools.pairwise(times)] if ok else [],
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": n if ok else 0,
            "expected_output_tokens": self.expected_output_tokens,
            "error": self.error,
        }


def normalize_base_url(url: str) -> str:
    """``http://host:port`` from ``http://host:port[/v1][/]``."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must start with http:// or https://, got {url!r}")
    return url


def error_message(status: int, body: bytes | str) -> str:
    """``HTTP <status>: <message>`` from an OpenAI, FastAPI or plain error body."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    message = text.strip()
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail", obj.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            message = err if isinstance(err, str) else json.dumps(err)
    return f"HTTP {status}: {message[:MAX_ERROR_CHARS] or '(empty body)'}"


async def fetch_models(client: httpx.AsyncClient, base_url: str,
                       headers: dict[str, str]) -> list[str]:
    """Model ids of ``GET /v1/models`` (raises RuntimeError if the server is unreachable)."""
    import httpx

    try:
        resp = await client.get(f"{base_url}/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"cannot reach {base_url}: {type(exc).__name__}: {exc}") from None
    if resp.status_code != 200:
        message = error_message(resp.status_code, resp.content)
        raise RuntimeError(f"GET {base_url}/v1/models: {message}")
    data = resp.json().get("data") or []
    return [m["id"] for m in data if isinstance(m, dict) and "id" in m]


def _chunk_output(choice: dict[str, Any], chat: bool) -> bool:
    """Whether a streamed choice carries output (see the module docstring)."""
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if not isinstance(text, str) or (not text and "role" in delta):
            return False
    else:
        text = choice.get("text")
        if not isinstance(text, str):
            return False
    return bool(text) or choice.get("finish_reason") is None


async def send(client: httpx.AsyncClient, url: str, payload: dict[str, Any],
               headers: dict[str, str], record: RequestRecord, start: float,
               on_token: Callable[[], None] | None = None) -> None:
    """POST one streaming request and fill ``record`` (never raises for request failures);
    ``on_token`` is called on every output chunk."""
    import httpx

    chat = "messages" in payload
    usage: dict[str, Any] | None = None
    finish = None
    record.arrival_time = time.perf_counter() - start
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = await resp.aread()
                record.fail(error_message(resp.status_code, body), time.perf_counter() - start)
                return
            async for line in resp.aiter_lines():
                now = time.perf_counter() - start
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error") is not None:
                    record.fail(error_message(resp.status_code, data), now)
                    return
                if obj.get("usage"):
                    usage = obj["usage"]
                for choice in obj.get("choices") or ():
                    finish = choice.get("finish_reason") or finish
                    if _chunk_output(choice, chat):
                        if record.first_token_time is None:
                            record.first_token_time = now
                        record.token_times.append(now)
                        if on_token is not None:
                            on_token()
    except (httpx.HTTPError, ValueError, TypeError, AttributeError) as exc:  # bad stream too
        record.fail(f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS], time.perf_counter() - start)
        return
    now = time.perf_counter() - start
    record.finished_time = now
    if record.first_token_time is None:
        record.first_token_time = now
    if usage:
        record.num_output_tokens = int(usage.get("completion_tokens") or 0)
        record.num_prompt_tokens = int(usage.get("prompt_tokens") or record.num_prompt_tokens)
    else:
        record.num_output_tokens = len(record.token_times)
    record.status = "FINISHED_LENGTH" if finish == "length" else "FINISHED_STOPPED"
