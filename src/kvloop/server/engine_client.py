"""What the HTTP layer asks of an engine: one typed surface, served by ``AsyncEngine`` (one
engine in this process) and by ``kvloop.cluster.ray_serve.ClusterEngine`` (replicas behind
a Ray deployment handle)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from kvloop.engine.intake import EngineLimits, ValidatedRequest
from kvloop.server.streams import RequestStream


class EngineClient(Protocol):
    """The engine as the server sees it: requests in, streams of outputs back."""

    limits: EngineLimits
    """What every request must fit (validated before it is added)."""
    tokenizer: Any | None
    """The model's tokenizer (None: token ids only)."""
    default_sampling: dict[str, Any]
    """Sampling defaults for requests that leave a field out."""
    clock: Callable[[], float]
    """The engine's clock (arrival times)."""
    draining: bool
    """Set when the server is shutting down: no new requests."""

    def start(self) -> None:
        """Start serving (from the server's lifespan, on its event loop)."""

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop serving; requests in flight end with an error."""

    @property
    def is_alive(self) -> bool:
        """Whether requests can still be served."""

    @property
    def num_active(self) -> int:
        """Requests added and not finished."""

    def add_request(self, request_id: str, request: ValidatedRequest, *,
                    arrival_time: float | None = None) -> RequestStream:
        """Queue a validated request; its outputs (or its error) arrive on the stream."""

    def abort(self, request_id: str) -> None:
        """Stop one request (unknown ids are ignored)."""

    def abort_all(self) -> None:
        """Stop every request."""
