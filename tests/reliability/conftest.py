"""Fixtures of the reliability suite: the server tests' tiny model and live servers
(``tests/server/serverkit.py``), plus a leak check that every test here ends with."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from reliakit import assert_no_leaks
from serverkit import LiveServer, build_tiny_model, server_factory, start_server


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-reliability"))


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    """A server of this module's own (so leak checks see only this module's traffic)."""
    live = start_server(tiny_model)
    yield live
    assert_no_leaks(live)
    live.stop()


@pytest.fixture
def new_server(tiny_model: Path) -> Iterator[Callable[..., LiveServer]]:
    """A factory of extra in-process servers, leak-checked and stopped after the test."""
    with server_factory(tiny_model, check=assert_no_leaks) as make:
        yield make
