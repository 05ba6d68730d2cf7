"""``KvloopRequestRouter``'s bookkeeping, without a Ray cluster: what it counts as a
replica's load between two polls of its stats. (Each test runs in an event loop: the
router schedules its completion callbacks on the loop it routes from.)"""

from __future__ import annotations

import asyncio
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


class FakeResult:
    """A ``ReplicaResult``'s ``add_done_callback`` (Ray fires it once, on another thread)."""

    def __init__(self) -> None:
        self.callbacks: list[Any] = []

    def add_done_callback(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def finish(self) -> None:
        for cb in self.callbacks:
            cb(self)


def routed(i: int) -> RoutedRequest:
    return RoutedRequest(f"r{i}", None, 0.0, RouteRequest(f"r{i}"))  # type: ignore[arg-type]


async def settle() -> None:
    """Let the callbacks Ray would schedule on the router's loop run."""
    for _ in range(3):
        await asyncio.sleep(0)


def make_router() -> KvloopRequestRouter:
    r = KvloopRequestRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    r.initialize_state(router="kv-aware")
    return r


def test_only_routed_requests_lower_a_replicas_ongoing_count() -> None:
    async def scenario() -> None:
        router = make_router()
        a = replica("A", num_waiting=0, num_running=2, num_received=2)
        results = [FakeResult(), FakeResult()]
        for i, res in enumerate(results):
            router.on_request_routed(pending(routed(i), f"http-{i}"), a.replica_id, res)
        # A /metrics call to A completes: its stats still say 2 running, so does the router.
        router.on_request_routed(pending(ReplicaTarget("A"), "http-9"), a.replica_id,
                                 FakeResult())
        router.on_request_completed(a.replica_id, "http-9")
        await settle()
        assert router._load(a) == ReplicaLoad(num_waiting=0, num_running=2)
        # One routed request completes before A's next poll: the stale stats are capped.
        results[0].finish()
        await settle()
        assert router._load(a) == ReplicaLoad(num_waiting=0, num_running=1)

    asyncio.run(scenario())


def test_a_request_done_before_it_is_marked_routed_still_completes() -> None:
    """A replica that answers at once (a 429 from its queue) can finish before Ray calls
    ``on_request_routed``: the count must still come back down."""
    async def scenario() -> None:
        router = make_router()
        a = replica("A", num_waiting=0, num_running=0, num_received=1)
        done = FakeResult()
        router.on_request_completed(a.replica_id, "http-1")  # Ray's own callback came first
        router.on_request_routed(pending(routed(1), "http-1"), a.replica_id, done)
        done.finish()
        await settle()
        assert router._ongoing == {"A": 0} and router._load(a).num_requests == 0

    asyncio.run(scenario())


def test_requests_routed_since_the_last_poll_count_as_waiting() -> None:
    async def scenario() -> None:
        router = make_router()
        b = replica("B", num_waiting=0, num_running=0, num_received=0)
        router.on_request_routed(pending(routed(1), "http-1"), b.replica_id, FakeResult())
        assert router._load(b) == ReplicaLoad(num_waiting=1, num_running=0)
        b.routing_stats = {"num_waiting": 0, "num_running": 1, "num_received": 1}
        assert router._load(b) == ReplicaLoad(num_waiting=0, num_running=1)

    asyncio.run(scenario())
