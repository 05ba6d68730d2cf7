"""Incremental detokenizer of one request: token ids in, new text out, stop strings applied.

Multi-byte characters split across tokens are held back until complete, so a streamed delta
never ends in a partial character (no U+FFFD for an incomplete UTF-8 sequence). This uses
``tokenizers.decoders.DecodeStream`` where the installed ``tokenizers`` has it, else the
prefix/read-offset technique (vLLM's): decode a few tokens of context with and without the new
ones and emit the difference once it no longer ends in U+FFFD.

Both decode every held-back token again at each new one, so a run of tokens that never ends a
character (invalid UTF-8, which a model can generate without end) would make each token cost
more than the last. From ``HELD_TOKENS`` held back, the text that no later token can change
(up to an invalid sequence that more text already follows) is released; from
``MAX_HELD_TOKENS`` everything is, as ``flush()`` does.

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
HELD_TOKENS = 8
"""Tokens held back from which ``Detokenizer.add`` releases the part of their text that no later
token can change (every ``HELD_TOKENS``-th token held)."""
MAX_HELD_TOKENS = 64
"""Tokens held back at most: past this many their text is released as ``flush()`` does, with
U+FFFD for a character still incomplete. NOTE: only a run of tokens none of which ends a
character gets here (a valid text whose every token boundary falls inside a character, or bytes
that are no text): a bound on the work each token costs, not a limit natural text meets."""
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
        self._use_decode_stream = use_decode_stream and DecodeStream is not None
        self._context: list[int] = []  # the stream's context: the tokens just before ``_pending``
        self._stream = self._new_stream(context)
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
            self._feed(token_id)
            held = len(self._pending)
            if held > MAX_HELD_TOKENS:
                self._release_held()
            elif held and held % HELD_TOKENS == 0:
                self._release_final()
        if self._check_stop(start):
            return self._emit(len(self._text)), True
        return self._emit(len(self._text) - self._hold), False

    def flush(self) -> str:
        """At the request's end: the held-back text (and any dangling partial character)."""
        if self._stopped or self._finished:
            return ""
        self._finished = True
        start = len(self._text)
        self._release_held()
        self._check_stop(start)
        return self._emit(len(self._text))

    def _new_stream(self, context: list[int]) -> _Stream:
        """A stream after ``context`` (``_context`` set to it), or after none where that ends
        in an incomplete or invalid character."""
        # NOTE: DecodeStream emits a context whose text ends in U+FFFD as if it were output,
        # and a prefix that later tokens may change would let a completed character be lost.
        self._context = context = self._context_or_none(context)
        if self._use_decode_stream:
            return DecodeStream(ids=context or None, skip_special_tokens=self._skip)
        return PrefixOffsetStream(context, skip_special_tokens=self._skip)

    def _context_or_none(self, context: list[int]) -> list[int]:
        return [] if context and self._decode(context).endswith(_INCOMPLETE) else context

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _feed(self, token_id: int) -> None:
        """One token into the stream: its text, once no longer incomplete, onto ``_text``."""
        self._pending.append(token_id)
        chunk = self._stream.step(self._tokenizer, token_id)
        if chunk is not None:
            self._text += chunk
            self._context = (self._context + self._pending)[-CONTEXT_TOKENS:]
            self._pending = []

    def _release_held(self) -> None:
        """Every held-back token's text onto ``_text`` (U+FFFD for an incomplete character)
        and a new stream after them."""
        if not self._pending:
            return
        ctx, held = self._context, self._pending
        full, before = self._decode(ctx + held), self._decode(ctx)
        self._text += full[len(before):] if full.startswith(before) else self._decode(held)
        self._pending = []
        self._stream = self._new_stream((ctx + held)[-CONTEXT_TOKENS:])

    def _release_final(self) -> None:
        """The held-back text that no later token can change onto ``_text``: up to the last of
        the final ``HELD_TOKENS`` token boundaries after which the held text goes on (an
        invalid sequence there is final once any text follows it); the tokens after it go
        into a new stream."""
        ctx, held = self._context, self._pending
        before, full = self._decode(ctx), self._decode(ctx + held)
        for cut in range(len(held) - 1, max(len(held) - HELD_TOKENS, 1) - 1, -1):
            part = self._decode(ctx + held[:cut])
            if not (part.startswith(before) and full.startswith(part) and len(full) > len(part)):
                continue
            # NOTE: the held text goes on after ``part``, but the tokens after the cut may still
            # continue its last (incomplete) sequence: cut only where they decode on their own
            # (after the context the new stream gets) to the rest of ``full``.
            rest = self._context_or_none((ctx + held[:cut])[-CONTEXT_TOKENS:])
            if self._decode(rest + held[cut:])[len(self._decode(rest)):] == full[len(part):]:
                break
        else:
            return
        self._text += part[len(before):]
        self._pending = []
        self._stream = self._new_stream((ctx + held[:cut])[-CONTEXT_TOKENS:])
        for token_id in held[cut:]:
            self._feed(token_id)

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
