"""``kvloop trace view``: serve the web view of one recorded trace on a local port.

A standard-library HTTP server on one thread per connection: ``/`` is the page,
``/app.js`` and ``/app.css`` its files, ``/trace.json`` the trace (built once at start).
Any other path answers 404 with a message.
"""

from __future__ import annotations

import json
import threading
import webbrowser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from kvloop.core.stats import StepRecord
from kvloop.server.page_headers import SECURITY_HEADERS
from kvloop.viz.web.assets import asset, page
from kvloop.viz.web.payload import trace_payload


class TraceViewServer(ThreadingHTTPServer):
    """Serves the page and one trace's ``trace.json``."""

    daemon_threads = True

    def __init__(self, records: list[StepRecord], source: str, host: str, port: int) -> None:
        self.body = json.dumps(trace_payload(records, source),
                               separators=(",", ":")).encode()
        """``trace.json``, encoded once."""
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/"

    def start(self) -> threading.Thread:
        """Serve on a background thread (tests); ``shutdown()`` stops it."""
        thread = threading.Thread(target=self.serve_forever, name="kvloop-trace-view",
                                  daemon=True)
        thread.start()
        return thread


class _Handler(BaseHTTPRequestHandler):
    server: TraceViewServer

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path in ("/", "/index.html"):
            self._send(200, page("trace"), "text/html; charset=utf-8")
        elif path == "/trace.json":
            self._send(200, self.server.body, "application/json")
        elif (found := asset(path.lstrip("/"))) is not None:
            self._send(200, *found)
        else:
            self._send(404, f"not found: {path} (the page is at /)\n".encode(),
                       "text/plain; charset=utf-8")

    def _send(self, code: int, body: bytes, kind: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for name, value in SECURITY_HEADERS.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # NOTE: quiet: the command prints its URL and nothing per request


def serve_trace(path: str, records: list[StepRecord], *, host: str = "127.0.0.1",
                port: int = 0, open_browser: bool = True) -> int:
    """Serve ``records`` (read from ``path``) until Ctrl-C; prints the URL first."""
    if not records:
        raise ValueError(f"{path}: the trace has no step records")
    try:
        server = TraceViewServer(records, Path(path).name, host, port)
    except OSError as exc:
        raise RuntimeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    print(f"kvloop trace view: {len(records)} steps from {path} at {server.url} "
          "(Ctrl-C to stop)", flush=True)
    if open_browser:
        webbrowser.open(server.url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
