"""Every shell and Python block of the README and of the tutorial runs, in order, one folder
per page (a block sees the files the blocks above it wrote), on the default model.

A comment right above a block steers it:

- ``<!-- docs-test: skip REASON -->``: not run; the test is reported as skipped with the
  reason (``pytest -rs`` lists them).
- ``<!-- docs-test: background -->``: a server, started in the background for the blocks
  below it and stopped after the page; the next block runs once ``/health`` answers.
- ``<!-- docs-test: replace "OLD" "NEW" -->``: run with OLD replaced by NEW (repeatable),
  to keep a documented size realistic and the test fast.

Port 8000 is replaced by a free port everywhere, so the page's server does not collide with
another on the machine.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", "docs/tutorial/scheduler-loop.md"]
RUNNABLE = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python"}
BLOCK_TIMEOUT_S = 300

_BLOCK = re.compile(
    r"(?P<directives>(?:^<!--\s*docs-test:.*?-->\n)*)^```(?P<lang>\w*)\n(?P<code>.*?)^```",
    re.S | re.M)
_DIRECTIVE = re.compile(r"<!--\s*docs-test:\s*(?P<kind>\w+)\s*(?P<arg>.*?)\s*-->")


@dataclass
class Block:
    page: str
    index: int
    lang: str
    code: str
    line: int
    skip: str | None = None
    background: bool = False
    replace: list[tuple[str, str]] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}-{self.lang}"


def blocks(page: str) -> list[Block]:
    text = (ROOT / page).read_text()
    out: list[Block] = []
    for m in _BLOCK.finditer(text):
        lang = m["lang"]
        if lang not in RUNNABLE:
            continue
        line = text.count("\n", 0, m.start("code"))
        b = Block(page, len(out), RUNNABLE[lang], m["code"], line)
        for d in _DIRECTIVE.finditer(m["directives"]):
            if d["kind"] == "skip":
                b.skip = d["arg"] or "marked skip"
            elif d["kind"] == "background":
                b.background = True
            elif d["kind"] == "replace":
                old, new = re.fullmatch(r'"(.*)"\s+"(.*)"', d["arg"]).groups()
                b.replace.append((old, new))
            else:
                raise ValueError(f"{page}:{line}: unknown docs-test directive {d['kind']!r}")
        out.append(b)
    return out


ALL = [b for page in PAGES for b in blocks(page)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PageRun:
    """The folder, port and background servers the blocks of one page share."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = _free_port()
        self.servers: list[subprocess.Popen] = []
        self.pending_health = False
        self.env = {**os.environ,
                    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

    def source(self, b: Block) -> str:
        code = b.code
        for old, new in b.replace:
            assert old in code, f"{b.id}: replace target {old!r} not in the block"
            code = code.replace(old, new)
        return re.sub(r"\b8000\b", str(self.port), code)

    def command(self, b: Block) -> list[str]:
        code = self.source(b)
        if b.lang == "python":
            return [sys.executable, "-c", code]
        return ["bash", "-e", "-o", "pipefail", "-c", code]

    def server_log(self) -> str:
        logs = sorted(self.folder.glob("server-*.log"))
        return logs[-1].read_text()[-3000:] if logs else ""

    def wait_healthy(self, timeout_s: float = 180.0) -> None:
        url = f"http://127.0.0.1:{self.port}/health"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.servers):
                raise AssertionError("the page's server exited before answering /health:\n"
                                     + self.server_log())
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        self.pending_health = False
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"no answer from {url} within {timeout_s:.0f} s:\n"
                             + self.server_log())

    def stop(self) -> None:
        for p in self.servers:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()


_RUNS: dict[str, PageRun] = {}


@pytest.fixture(scope="module", autouse=True)
def _page_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    for page in PAGES:
        _RUNS[page] = PageRun(tmp_path_factory.mktemp(Path(page).stem))
    yield
    for run in _RUNS.values():
        run.stop()
    _RUNS.clear()


def test_pages_have_blocks() -> None:
    counts = {page: sum(b.page == page for b in ALL) for page in PAGES}
    skipped = [b for b in ALL if b.skip]
    print(f"docs blocks: {len(ALL)} in {counts}; {len(ALL) - len(skipped)} run, "
          f"{len(skipped)} skipped: " + "; ".join(f"{b.id}: {b.skip}" for b in skipped))
    assert all(counts.values()), counts
    assert len(skipped) <= len(ALL) // 3, "most documented commands must run"


@pytest.mark.parametrize("block", ALL, ids=[b.id for b in ALL])
def test_block_runs(block: Block) -> None:
    if block.skip:
        pytest.skip(f"{block.id}: {block.skip}")
    if block.lang == "bash" and shutil.which("kvloop", path=_RUNS[block.page].env["PATH"]) \
            is None:
        pytest.fail("the kvloop command is not installed (pip install -e '.[dev]')")
    run = _RUNS[block.page]
    if block.background:
        log = open(run.folder / f"server-{block.index}.log", "w")  # noqa: SIM115
        run.servers.append(subprocess.Popen(
            run.command(block), cwd=run.folder, env=run.env, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True))
        run.pending_health = True
        return
    if run.pending_health:
        run.wait_healthy()
    proc = subprocess.run(run.command(block), cwd=run.folder, env=run.env,
                          capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert proc.returncode == 0, (
        f"{block.id} exited {proc.returncode}\n--- block ---\n{run.source(block)}"
        f"\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}")
