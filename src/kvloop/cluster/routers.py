"""Routers: which replica serves a request. Pure Python, no Ray and no torch.

The very same router objects drive the Ray Serve deployment (``cluster/ray_serve.py``
adapts them to Ray's request-router extension point) and the cluster simulator
(``sim/cluster.py``), so a router chosen on a laptop is the router that serves.

A router sees a request as a ``RouteRequest`` (its leading prompt block hashes, from
``core/prefix_hash.py``, which are equal in every process) and each replica as a
``ReplicaLoad`` snapshot, and returns the replicas best first (``rank``). It is told where
each request went (``on_routed``), which is how ``kv-aware`` learns what each replica holds.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from kvloop.core.prefix_hash import chain_hashes, root_hash, token_bytes


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What a router knows of one replica's load at the moment it routes."""

    num_waiting: int = 0
    """Requests queued at the replica and not yet running."""
    num_running: int = 0
    """Requests the replica is running."""
    kv_usage: float = 0.0
    """Used fraction of the replica's KV blocks (0..1)."""

    @property
    def num_requests(self) -> int:
        """Waiting plus running: the queue a new request joins."""
        return self.num_waiting + self.num_running


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a router sees of a request."""

    request_id: str
    block_hashes: Sequence[bytes] = field(default=())
    """Hashes of the prompt's leading full blocks (``prefix_hash.chain_hashes``, cache salt
    included), at most ``MAX_ROUTED_BLOCKS``."""


MAX_ROUTED_BLOCKS = 256
"""Leading prompt blocks a router looks at (4096 tokens at block size 16): routing cost stays
bounded however long the prompt is."""


class Router(ABC):
    """Ranks replicas for a request; one object per deployment (not thread-safe)."""

    name: ClassVar[str]

    @abstractmethod
    def rank(self, request: RouteRequest, loads: Mapping[str, ReplicaLoad]) -> list[str]:
        """The replicas of ``loads`` (by id), best first. ``loads`` is never empty."""

    def on_routed(self, request: RouteRequest, replica: str) -> None:  # noqa: B027
        """``request`` was sent to ``replica`` (default: nothing to learn)."""

    def on_replica_removed(self, replica: str) -> None:  # noqa: B027
        """``replica`` is gone (default: nothing to forget)."""

    def choose(self, request: RouteRequest, loads: Mapping[str, ReplicaLoad]) -> str:
        """Rank, take the best and record it: what a caller with no fallback does."""
        best = self.rank(request, loads)[0]
        self.on_routed(request, best)
        return best


def _by_load(loads: Mapping[str, ReplicaLoad]) -> list[str]:
    """Replicas least loaded first: fewest requests, then least KV in use, then id."""
    return sorted(loads, key=lambda r: (loads[r].num_requests, loads[r].kv_usage, r))


class RoundRobinRouter(Router):
    """Each replica in turn (by id order), whatever its load: the baseline."""

    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def rank(self, request: RouteRequest, loads: Mapping[str, ReplicaLoad]) -> list[str]:
        ids = sorted(loads)
        k = next(self._turn) % len(ids)
        return ids[k:] + ids[:k]


class LeastLoadedRouter(Router):
    """The replica with the fewest waiting + running requests (ties: least KV in use)."""

    name = "least-loaded"

    def rank(self, request: RouteRequest, loads: Mapping[str, ReplicaLoad]) -> list[str]:
        return _by_load(loads)


class KVAwareRouter(Router):
    """Prefix affinity with a load penalty, from a router-side index of cached blocks.

    The index maps a block hash to the replicas that were sent a prompt holding it, each
    replica's entries kept in LRU order and capped at ``cache_blocks`` (about what its KV
    cache holds), so an entry ages out roughly when the replica's cache would evict it.

    For a request with B leading blocks, replica r scores

        score(r) = matched(r) / B − load_penalty · requests(r) / max(1, max_q requests(q))

    where matched(r) counts the leading blocks r holds (stopping at the first it lacks).
    The best score wins, ties to the less loaded. Spill: when the winner has more than
    ``imbalance`` requests more than the least loaded replica, the least loaded wins instead
    (a hot prefix must not pile every request on one replica). A request no replica holds
    any block of goes to the least loaded (ties: the one believed to cache the least).
    """

    name = "kv-aware"

    def __init__(self, *, cache_blocks: int = 100_000, load_penalty: float = 1.0,
                 imbalance: int = 16) -> None:
        if cache_blocks < 1:
            raise ValueError(f"cache_blocks must be >= 1, got {cache_blocks}")
        if load_penalty < 0:
            raise ValueError(f"load_penalty must be >= 0, got {load_penalty}")
        if imbalance < 0:
            raise ValueError(f"imbalance must be >= 0, got {imbalance}")
        self.cache_blocks = cache_blocks
        """Index entries kept per replica (LRU)."""
        self.load_penalty = load_penalty
        """Weight of the relative load against the matched fraction of the prompt. At 1 a
        whole prompt cached on the busiest replica ties with nothing cached on an idle one
        (with 0.5 p99 TTFT fell behind least-loaded's on Mooncake at light load,
        docs/cluster.md)."""
        self.imbalance = imbalance
        """Extra requests over the least loaded replica that make the winner spill."""
        self._holders: dict[bytes, set[str]] = {}
        """Block hash -> replicas believed to hold it."""
        self._lru: dict[str, OrderedDict[bytes, None]] = {}
        """Per replica, its believed blocks, least recently routed first."""

    def matched(self, request: RouteRequest, replicas: Sequence[str]) -> dict[str, int]:
        """Leading blocks of ``request`` each of ``replicas`` is believed to hold."""
        out = dict.fromkeys(replicas, 0)
        alive = set(replicas)
        for h in request.block_hashes:
            alive &= self._holders.get(h, set())
            if not alive:
                break
            for r in alive:
                out[r] += 1
        return out

    def rank(self, request: RouteRequest, loads: Mapping[str, ReplicaLoad]) -> list[str]:
        # NOTE: among equally loaded replicas the one believed to cache the least comes
        # first, so new prefixes spread over the cluster instead of piling on one replica.
        by_load = sorted(loads, key=lambda r: (loads[r].num_requests, loads[r].kv_usage,
                                               len(self._lru.get(r, ())), r))
        n_blocks = len(request.block_hashes)
        matched = self.matched(request, by_load) if n_blocks else {}
        if not any(matched.values()):
            return by_load
        top = max(1, max(loads[r].num_requests for r in by_load))
        position = {r: i for i, r in enumerate(by_load)}

        def score(r: str) -> tuple[float, int]:
            s = matched[r] / n_blocks - self.load_penalty * loads[r].num_requests / top
            return (-s, position[r])

        ranked = sorted(by_load, key=score)
        least = by_load[0]
        if loads[ranked[0]].num_requests - loads[least].num_requests > self.imbalance:
            ranked.remove(least)
            ranked.insert(0, least)
        return ranked

    def on_routed(self, request: RouteRequest, replica: str) -> None:
        lru = self._lru.setdefault(replica, OrderedDict())
        for h in request.block_hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._holders.setdefault(h, set()).add(replica)
        while len(lru) > self.cache_blocks:
            old, _ = lru.popitem(last=False)
            self._forget(old, replica)

    def on_replica_removed(self, replica: str) -> None:
        for h in self._lru.pop(replica, OrderedDict()):
            self._forget(h, replica)

    def _forget(self, block_hash: bytes, replica: str) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[block_hash]


ROUTERS: dict[str, Callable[..., Router]] = {
    RoundRobinRouter.name: RoundRobinRouter,
    LeastLoadedRouter.name: LeastLoadedRouter,
    KVAwareRouter.name: KVAwareRouter,
}
"""Router names (the ``--router`` choices) to their classes."""
DEFAULT_ROUTER = KVAwareRouter.name
"""The router of ``kvloop serve --replicas`` and ``kvloop simulate --replicas`` unless
``--router`` names another (one default, so a simulation predicts the served fleet)."""


def check_router(name: str, field: str = "router") -> None:
    """``ValueError`` naming ``field`` (``--router`` on the command line) for an unknown
    router name."""
    if name not in ROUTERS:
        raise ValueError(f"{field} must be one of {', '.join(ROUTERS)}, got {name!r}")


def make_router(name: str, **kwargs: object) -> Router:
    """A router by name (``ValueError`` naming ``router`` for an unknown one); ``kwargs``
    go to ``KVAwareRouter`` (``cache_blocks``, ``load_penalty``, ``imbalance``) and are
    ignored by routers that take none."""
    check_router(name)
    cls = ROUTERS[name]
    return cls(**kwargs) if cls is KVAwareRouter else cls()


def route_request(request_id: str, prompt_token_ids: Sequence[int], block_size: int,
                  cache_salt: str | None = None) -> RouteRequest:
    """The ``RouteRequest`` of a prompt: hashes of its leading full blocks, as the replicas'
    prefix caches compute them (same salt, same chain), at most ``MAX_ROUTED_BLOCKS``."""
    n = min(len(prompt_token_ids) // block_size, MAX_ROUTED_BLOCKS)
    if n == 0:
        return RouteRequest(request_id)
    data = token_bytes(prompt_token_ids[: n * block_size])
    return RouteRequest(request_id, tuple(chain_hashes(root_hash(cache_salt), data,
                                                       block_size, n)))
