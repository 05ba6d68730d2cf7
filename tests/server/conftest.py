"""Fixtures of the server tests (helpers live in ``serverkit``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from serverkit import LiveServer, build_tiny_model, server_factory, start_server


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    live = start_server(tiny_model)
    yield live
    live.stop()


@pytest.fixture
def new_server(tiny_model: Path) -> Iterator[Callable[..., LiveServer]]:
    """A factory of extra in-process servers, stopped after the test."""
    with server_factory(tiny_model) as make:
        yield make


