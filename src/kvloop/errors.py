"""Errors that carry data, not strings to parse (stdlib only: every layer may raise them)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request that cannot be accepted: ``field`` names the bad input, ``message`` says why.

    A ``ValueError``, so callers that catch those keep working; the server reports ``field``
    as the OpenAI error's ``param`` without looking inside the message.
    """

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field
        """The request field at fault (``prompt``, ``max_tokens``, ``temperature``, ...), or
        None when no single field is."""
        self.message = message
        """Human-readable reason, naming the field too."""
