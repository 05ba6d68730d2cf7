"""The server is written against one typed engine surface (``EngineClient``): the local
``AsyncEngine`` and the Ray ``ClusterEngine`` both provide every member of it."""

from __future__ import annotations

import inspect

import pytest

from kvloop.server.async_engine import AsyncEngine
from kvloop.server.engine_client import EngineClient

MEMBERS = sorted(n for n in {*EngineClient.__annotations__, *vars(EngineClient)}
                 if not n.startswith("_"))


def _provides(cls: type, instance_fields: set[str]) -> list[str]:
    return [n for n in MEMBERS if not hasattr(cls, n) and n not in instance_fields]


def _init_fields(cls: type) -> set[str]:
    """Attributes ``cls.__init__`` assigns (``self.x = ...``) or a dataclass declares."""
    if hasattr(cls, "__dataclass_fields__"):
        return set(cls.__dataclass_fields__)
    source = inspect.getsource(cls.__init__)
    assigned = {line.split("self.", 1)[1].split(":")[0].split("=")[0].strip()
                for line in source.splitlines() if line.strip().startswith("self.")}
    return assigned


def test_the_protocol_names_what_the_server_uses() -> None:
    assert {"add_request", "abort", "abort_all", "start", "shutdown", "is_alive",
            "num_active", "limits", "tokenizer", "default_sampling", "draining",
            "clock"} <= set(MEMBERS)


def test_the_local_engine_provides_it() -> None:
    assert _provides(AsyncEngine, _init_fields(AsyncEngine)) == []


def test_the_cluster_engine_provides_it() -> None:
    ray_serve = pytest.importorskip("kvloop.cluster.ray_serve", exc_type=ImportError)
    cls = ray_serve.ClusterEngine
    assert _provides(cls, _init_fields(cls)) == []
