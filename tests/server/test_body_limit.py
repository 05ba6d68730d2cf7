"""``--max-request-bytes``: a body over the limit gets 413 in OpenAI's error shape before it
is read in full, whether it declares its length or streams in chunks; the API key is checked
before the size; the connection stays usable."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterable, Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from serverkit import MODEL_NAME, LiveServer

from kvloop.server import DEFAULT_MAX_REQUEST_BYTES

LIMIT = 4096
OK_BODY = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}


def padded(size: int) -> bytes:
    """A valid completion body of exactly ``size`` bytes (JSON ends in whitespace)."""
    raw = json.dumps(OK_BODY).encode()
    assert size >= len(raw)
    return raw + b" " * (size - len(raw))


def raw_exchange(url: str, head: str, parts: Iterable[bytes], timeout: float = 10
                 ) -> tuple[int, dict[str, str], bytes]:
    """Send a request head and some body parts (never the rest), then read the response."""
    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=timeout) as sock:
        sock.sendall(head.encode())
        for part in parts:
            sock.sendall(part)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed before a response: {data!r}"
            data += chunk
        raw_head, _, body = data.partition(b"\r\n\r\n")
        status_line, *lines = raw_head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(":") for line in lines)}
        while len(body) < int(headers["content-length"]):
            chunk = sock.recv(65536)
            assert chunk
            body += chunk
    return int(status_line.split()[1]), headers, body


def head(path: str, extra: str) -> str:
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"{extra}\r\n")


def assert_413(status: int, body: bytes | dict) -> None:
    assert status == 413
    err = (json.loads(body) if isinstance(body, bytes) else body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == 413 and err["param"] is None
    assert "--max-request-bytes" in err["message"]


def test_declared_length_over_the_limit_is_refused_before_the_body(server: LiveServer) -> None:
    """50 MB declared, 1 KB sent: the 413 comes without the server waiting for the rest."""
    t0 = time.monotonic()
    status, headers, body = raw_exchange(
        server.url, head("/v1/completions", "Content-Length: 50000000\r\n"), [b"{" * 1024])
    assert_413(status, body)
    assert headers["content-type"] == "application/json"
    assert time.monotonic() - t0 < 5


def test_chunked_body_is_cut_off_once_over_the_limit(server: LiveServer) -> None:
    """A chunked body with no length: 413 once the bytes pass the (default 1 MiB) limit,
    although the body never ends."""
    piece = b" " * 65536
    n = DEFAULT_MAX_REQUEST_BYTES // len(piece) + 1
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * n
    status, _, body = raw_exchange(
        server.url, head("/v1/completions", "Transfer-Encoding: chunked\r\n"), chunks)
    assert_413(status, body)


def _chunks(data: bytes, size: int = 1000) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


@pytest.fixture(scope="module")
def small_limit(tiny_model) -> Iterator[LiveServer]:
    from serverkit import start_server

    live = start_server(tiny_model, api_key="k", server_config={"max_request_bytes": LIMIT})
    yield live
    live.stop()


KEY = {"Authorization": "Bearer k", "Content-Type": "application/json"}


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_limit_is_exact(small_limit: LiveServer, chunked: bool) -> None:
    url = f"{small_limit.base_url}/completions"
    with httpx.Client(timeout=30, headers=KEY) as http:
        for size, expected in ((LIMIT, 200), (LIMIT + 1, 413)):
            data = padded(size)
            r = http.post(url, content=_chunks(data) if chunked else data)
            if chunked:
                assert r.request.headers.get("transfer-encoding") == "chunked"
            assert r.status_code == expected, (size, r.text)
        assert_413(r.status_code, r.json())
        # the same connection goes on: uvicorn discarded the rest of the refused body
        assert http.post(url, json=OK_BODY).status_code == 200


def test_api_key_is_checked_before_the_size(small_limit: LiveServer) -> None:
    url = f"{small_limit.base_url}/completions"
    big = padded(LIMIT * 4)
    anonymous = httpx.post(url, content=big, headers={"Content-Type": "application/json"})
    assert anonymous.status_code == 401
    keyed = httpx.post(url, content=big, headers=KEY)
    assert_413(keyed.status_code, keyed.json())


def test_every_route_has_the_limit(small_limit: LiveServer) -> None:
    r = httpx.request("GET", f"{small_limit.url}/health", content=b"x" * (LIMIT + 1))
    assert_413(r.status_code, r.json())


def test_cli_flag(capsys) -> None:
    from kvloop.cli import main
    from kvloop.cli.main import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.max_request_bytes == DEFAULT_MAX_REQUEST_BYTES == 1 << 20
    assert main(["serve", "--max-request-bytes", "-1"]) == 2
    assert "--max-request-bytes must be >= 0" in capsys.readouterr().err
