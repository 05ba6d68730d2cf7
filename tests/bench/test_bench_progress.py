"""``kvloop bench serve``'s progress line moves with every streamed token, before any request
finishes, and its --help shows the defaults (lengths included)."""

from __future__ import annotations

import io
import re

import pytest

from kvloop.bench.progress import BenchProgress
from kvloop.cli import main


def _frames(text: str) -> list[str]:
    return [f for f in re.split(r"[\r\n]", text) if f.strip()]


def test_progress_counts_tokens_in_flight():
    out = io.StringIO()
    bar = BenchProgress(3, expected_tokens=30, file=out, refresh_s=0.0)
    bar.on_sent()
    bar.on_sent()
    for _ in range(5):
        bar.on_token()
    last = _frames(out.getvalue())[-1]
    assert "5/30" in last and "sent 2/3, running 2, done 0" in last
    # One request ends with 4 tokens of its 10 by the server's count (3 chunks streamed).
    bar.on_finished(expected=10, streamed=3, produced=4, failed=False)
    assert (bar.tokens, bar.bar.total, bar.running) == (6, 24, 1)
    assert "sent 2/3, running 1, done 1" in _frames(out.getvalue())[-1]
    bar.on_sent()
    bar.on_finished(expected=10, streamed=0, produced=0, failed=True)
    assert "failed 1" in _frames(out.getvalue())[-1] and bar.bar.total == 14
    bar.close()


def test_progress_is_quiet_when_disabled():
    out = io.StringIO()
    bar = BenchProgress(1, 10, enabled=False, file=out)
    bar.on_sent()
    bar.on_token()
    bar.on_finished(10, 1, 10, False)
    bar.close()
    assert out.getvalue() == ""


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "serve", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--random-input-len", "128"), ("--random-output-len", "64"),
                          ("--num-prompts", "20"), ("--request-rate", "inf"),
                          ("--endpoint", "completions"), ("--temperature", "0"),
                          ("--base-url", "http://127.0.0.1:8000")):
        after = text.split(f"{flag} ", 2)[-1]
        assert f"(default: {default}" in after.split(" --")[0], (flag, after[:200])
