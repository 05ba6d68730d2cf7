"""Many replicas behind one endpoint: routers (pure Python), shared by the Ray Serve
deployment (``ray_serve``, imported only when used) and the cluster simulator."""

from kvloop.cluster.routers import (
    ROUTERS,
    KVAwareRouter,
    LeastLoadedRouter,
    ReplicaLoad,
    RoundRobinRouter,
    Router,
    RouteRequest,
    make_router,
    route_request,
)

__all__ = [
    "ROUTERS",
    "KVAwareRouter",
    "LeastLoadedRouter",
    "ReplicaLoad",
    "RoundRobinRouter",
    "RouteRequest",
    "Router",
    "make_router",
    "route_request",
]
