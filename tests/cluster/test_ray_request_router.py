"""``KvloopRequestRouter``'s bookkeeping, without a Ray cluster: what it counts as a
replica's load between two polls of its stats."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("ray")

from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest

from kvloop.cluster.ray_serve import (
    ENGINE_DEPLOYMENT,
    KvloopRequestRouter,
    ReplicaTarget,
    RoutedRequest,
)
from kvloop.cluster.routers import ReplicaLoad, RouteRequest

DEPLOYMENT = DeploymentID(name=ENGINE_DEPLOYMENT, app_name="kvloop")


@dataclass
class FakeReplica:
    """What ``_load`` reads of a ``RunningReplica``."""

    replica_id: ReplicaID
    routing_stats: dict[str, Any] = field(default_factory=dict)


def replica(name: str, **stats: Any) -> FakeReplica:
    return FakeReplica(ReplicaID(unique_id=name, deployment_id=DEPLOYMENT), stats)


def pending(arg: object, internal_id: str) -> PendingRequest:
    return PendingRequest(args=[arg], kwargs={},
                          metadata=RequestMetadata(request_id=internal_id,
                                                   internal_request_id=internal_id))


@pytest.fixture
def router() -> Iterator[KvloopRequestRouter]:
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # NOTE: Ray's router keeps the loop it was made on
    try:
        r = KvloopRequestRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        r.initialize_state(router="kv-aware")
        yield r
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def test_only_routed_requests_lower_a_replicas_ongoing_count(
        router: KvloopRequestRouter) -> None:
    a = replica("A", num_waiting=0, num_running=2, num_received=2)
    for i in (1, 2):
        req = RoutedRequest(f"r{i}", None, 0.0, RouteRequest(f"r{i}"))  # type: ignore[arg-type]
        router.on_request_routed(pending(req, f"http-{i}"), a.replica_id, None)
    # A /metrics call to A completes: its stats still say 2 running, and so does the router.
    router.on_request_routed(pending(ReplicaTarget("A"), "http-3"), a.replica_id, None)
    router.on_request_completed(a.replica_id, "http-3")
    assert router._load(a) == ReplicaLoad(num_waiting=0, num_running=2)
    # One routed request completes before A's next poll: the stale stats are capped.
    router.on_request_completed(a.replica_id, "http-1")
    assert router._load(a) == ReplicaLoad(num_waiting=0, num_running=1)
    router.on_request_completed(a.replica_id, "http-1")  # a duplicate is ignored
    assert router._load(a).num_requests == 1


def test_requests_routed_since_the_last_poll_count_as_waiting(
        router: KvloopRequestRouter) -> None:
    b = replica("B", num_waiting=0, num_running=0, num_received=0)
    req = RoutedRequest("r", None, 0.0, RouteRequest("r"))  # type: ignore[arg-type]
    router.on_request_routed(pending(req, "http-1"), b.replica_id, None)
    assert router._load(b) == ReplicaLoad(num_waiting=1, num_running=0)
    b.routing_stats = {"num_waiting": 0, "num_running": 1, "num_received": 1}
    assert router._load(b) == ReplicaLoad(num_waiting=0, num_running=1)
