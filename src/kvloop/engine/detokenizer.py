"""Incremental detokenizer of one request: token ids in, new text out, stop strings applied.

Multi-byte characters split across tokens are held back until complete, so a streamed delta
never ends in a partial character (no U+FFFD for an incomplete UTF-8 sequence). This uses
``tokenizers.decoders.DecodeStream`` where the installed ``tokenizers`` has it, else the
prefix/read-offset technique (vLLM's): decode a few tokens of context with and without the new
ones and emit the difference once it no longer ends in U+FFFD.

Stop strings: once the text contains one, it is cut just before the earliest match and the
request must stop (the stop string is never returned). While a stop string could still be
forming, the last ``max(len(stop)) - 1`` characters are held back from the deltas, so a stop
string split across tokens is never partly emitted; ``flush()`` returns them at the end.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

CONTEXT_TOKENS = 6
"""Tokens of context decoded before new ones (the prompt's tail for the first output token),
so that decoders which drop a leading space at the start of a text keep it mid-text."""
_INCOMPLETE = "\ufffd"


class _Stream(Protocol):
    def step(self, tokenizer: Any, token_id: int) -> str | None: ...


class PrefixOffsetStream:
    """``DecodeStream``'s contract without it: ``step`` returns the new text, or None while
    the tokens so far end in an incomplete character."""

    def __init__(self, ids: Sequence[int] | None = None, skip_special_tokens: bool = True):
        self._ids = list(ids or ())
        self._prefix = 0
        self._read = len(self._ids)
        self._skip = skip_special_tokens

    def step(self, tokenizer: Any, token_id: int) -> str | None:
        self._ids.append(token_id)
        skip = self._skip
        before = tokenizer.decode(self._ids[self._prefix:self._read], skip_special_tokens=skip)
        text = tokenizer.decode(self._ids[self._prefix:], skip_special_tokens=skip)
        if len(text) <= len(before) or text.endswith(_INCOMPLETE):
            return None
        del self._ids[:self._read]  # the new text's tokens become the next context
        self._prefix, self._read = 0, len(self._ids)
        return text[len(before):]


class Detokenizer:
    """Turns one request's output token ids into text deltas (see the module docstring).

    ``tokenizer`` is a ``tokenizers.Tokenizer`` (a fast tokenizer's ``backend_tokenizer``).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        *,
        skip_special_tokens: bool = True,
        use_decode_stream: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stops = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        context = list(prompt_ids[-CONTEXT_TOKENS:]) if prompt_ids else []
        self._stream: _Stream
        if use_decode_stream and DecodeStream is not None:
            self._stream = DecodeStream(ids=context or None, skip_special_tokens=self._skip)
        else:
            self._stream = PrefixOffsetStream(context, skip_special_tokens=self._skip)
        self._context = context  # the decoded tokens just before ``_pending``
        self._pending: list[int] = []  # fed tokens whose text the stream still holds back
        self._text = ""
        self._emitted = 0
        self._stopped = False
        self._finished = False
        self.stop_reason: str | None = None
        """The stop string that ended the request, if one did."""
        self.token_ids: list[int] = []
        """Every output token id fed so far."""

    @property
    def text(self) -> str:
        """The output text so far: emitted and held back, cut before a matched stop string."""
        return self._text

    @property
    def stopped(self) -> bool:
        """Whether a stop string matched (the request must stop)."""
        return self._stopped

    def add(self, token_ids: Iterable[int] | int) -> tuple[str, bool]:
        """Feed new output tokens; return (text safe to emit now, whether a stop string hit)."""
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        if self._stopped or self._finished:
            return "", self._stopped
        start = len(self._text)
        for token_id in ids:
            self.token_ids.append(token_id)
            self._pending.append(token_id)
            chunk = self._stream.step(self._tokenizer, token_id)
            if chunk is not None:
                self._text += chunk
                self._context = (self._context + self._pending)[-CONTEXT_TOKENS:]
                self._pending = []
        if self._check_stop(start):
            return self._emit(len(self._text)), True
        return self._emit(len(self._text) - self._hold), False

    def flush(self) -> str:
        """At the request's end: the held-back text (and any dangling partial character)."""
        if self._stopped or self._finished:
            return ""
        self._finished = True
        start = len(self._text)
        if self._pending:
            ctx = self._context
            full = self._tokenizer.decode(ctx + self._pending, skip_special_tokens=self._skip)
            before = self._tokenizer.decode(ctx, skip_special_tokens=self._skip)
            if full.startswith(before):
                self._text += full[len(before):]
            else:
                self._text += self._tokenizer.decode(self._pending, skip_special_tokens=self._skip)
            self._pending = []
        self._check_stop(start)
        return self._emit(len(self._text))

    def _check_stop(self, start: int) -> bool:
        """Cut the text before the earliest stop string that ends after ``start``."""
        if not self._stops or len(self._text) == start:
            return False
        # NOTE: text before ``start - hold`` was searched already, and ``_emitted`` never
        # passes ``len(text) - hold``, so a match never overlaps emitted text.
        lo = max(0, start - self._hold)
        hits = [(i, s) for s in self._stops if (i := self._text.find(s, lo)) >= 0]
        if not hits:
            return False
        cut, self.stop_reason = min(hits)
        self._text = self._text[:cut]
        self._stopped = True
        return True

    def _emit(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        delta = self._text[self._emitted:upto]
        self._emitted = upto
        return delta
