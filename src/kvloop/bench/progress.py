"""The benchmark's progress line: output tokens as they stream, and requests in flight.

A bar over requests stands still until the first request finishes, which on a slow server
is most of the run; this one counts every streamed output chunk against the tokens the
workload asks for, with the requests sent, running and done beside it::

    tokens:  35%|███▌      | 448/1280 [00:12<00:22, 37.2tok/s, sent 14/20, running 9, done 5]
"""

from __future__ import annotations

import time
from typing import IO, Any

__all__ = ["REFRESH_S", "BenchProgress"]

REFRESH_S = 0.1
"""Least seconds between two redraws of the line."""


class BenchProgress:
    """A tqdm line fed by the benchmark's requests (disabled: every call is a no-op)."""

    def __init__(self, num_requests: int, expected_tokens: int, *, enabled: bool = True,
                 file: IO[str] | None = None, refresh_s: float | None = None) -> None:
        from tqdm import tqdm

        self.num_requests = num_requests
        self.sent = self.done = self.failed = self.tokens = 0
        self.refresh_s = REFRESH_S if refresh_s is None else refresh_s
        self._last = 0.0
        self.bar: Any = tqdm(total=max(expected_tokens, 1), desc="tokens", unit="tok",
                             disable=not enabled, leave=False, file=file, mininterval=0,
                             dynamic_ncols=True)

    @property
    def running(self) -> int:
        """Requests sent and not yet answered in full."""
        return self.sent - self.done - self.failed

    def status(self) -> str:
        """The counts after the bar."""
        text = f"sent {self.sent}/{self.num_requests}, running {self.running}, done {self.done}"
        return text + (f", failed {self.failed}" if self.failed else "")

    def _draw(self, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self._last >= self.refresh_s:
            self._last = now
            self.bar.set_postfix_str(self.status(), refresh=False)
            self.bar.refresh()

    def on_sent(self) -> None:
        self.sent += 1
        self._draw()

    def on_token(self) -> None:
        self.tokens += 1
        self.bar.n = min(self.tokens, self.bar.total)
        self._draw()

    def on_finished(self, expected: int, streamed: int, produced: int, failed: bool) -> None:
        """A request ended: the tokens it produced (the server's usage count) replace the
        ``streamed`` chunks counted so far, and the total drops by what it did not produce
        of the ``expected``."""
        if failed:
            self.failed += 1
        else:
            self.done += 1
        self.tokens += produced - streamed
        self.bar.total = max(1, self.bar.total - (expected - produced))
        self.bar.n = min(self.tokens, self.bar.total)
        self._draw(force=True)

    def close(self) -> None:
        self.bar.close()
