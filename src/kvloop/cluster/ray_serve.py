"""kvloop on Ray Serve: N engine replicas behind one OpenAI-compatible ingress.

The only module that imports Ray. Three parts:

* ``EngineReplica``: one deployment replica = one kvloop engine (its own ``AsyncEngine``
  thread, KV cache and Prometheus registry). ``generate`` streams one request's outputs;
  ``record_routing_stats`` is what Ray polls for the router (waiting, running, KV usage).
* ``KvloopRequestRouter``: Ray Serve's request-router extension point around a
  ``kvloop.cluster.routers.Router`` (the very object the cluster simulator uses). Ray keeps
  its health checks, back-pressure and retries; the kvloop router only ranks replicas.
* ``Ingress``: the FastAPI app of ``kvloop serve`` (``server.app.create_app``: the same
  routes, validation, streaming, errors and API key) over a ``ClusterEngine`` that sends
  each validated request to a replica through a Ray deployment handle. ``/metrics`` merges
  the replicas' registries, each series labelled with its ``replica``.

A request is validated and tokenized once, at the ingress; the replica trusts it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvloop.cluster.routers import ReplicaLoad, RouteRequest, make_router, route_request
from kvloop.engine.args import EngineArgs
from kvloop.engine.intake import EngineLimits, ValidatedRequest
from kvloop.engine.outputs import RequestOutput
from kvloop.errors import InvalidRequestError
from kvloop.server.streams import (
    EngineStoppedError,
    QueueFullError,
    RequestAbortedError,
    RequestStream,
)

logger = logging.getLogger("kvloop.cluster")

ENGINE_DEPLOYMENT = "KvloopEngine"
INGRESS_DEPLOYMENT = "KvloopIngress"
ROUTING_STATS_PERIOD_S = 0.5
"""How often Ray asks each replica for its load (``record_routing_stats``)."""
METRICS_TIMEOUT_S = 5.0
"""How long ``/metrics`` waits for one replica's registry before leaving it out."""
MAX_ONGOING_REQUESTS = 1024
"""Requests Ray lets one replica hold at once: high, because the engine's own scheduler
queues and batches them (Ray's queue would only hide them from it)."""


# -- what crosses the Ray boundary (plain picklable data) -------------------------------
@dataclass(frozen=True, slots=True)
class RoutedRequest:
    """One validated request on its way to a replica."""

    request_id: str
    request: ValidatedRequest
    waited_s: float
    """Seconds since it arrived at the ingress (the replica's clock is its own)."""
    route: RouteRequest
    """What the router ranks replicas by."""


@dataclass(frozen=True, slots=True)
class ReplicaTarget:
    """A call meant for one replica (``/metrics``): the router sends it there only."""

    replica: str


@dataclass(frozen=True, slots=True)
class Failure:
    """An error raised in a replica, sent back as data (an exception pickled through Ray
    loses its type)."""

    kind: str
    """``queue_full``, ``stopped``, ``invalid`` or ``aborted``."""
    message: str
    status: int = 500
    field: str | None = None

    def exception(self) -> BaseException:
        """The exception the ingress's stream ends with."""
        if self.kind == "invalid":
            return InvalidRequestError(self.field, self.message)
        if self.kind == "queue_full":
            return RequestAbortedError(self.message, 429)
        return RequestAbortedError(self.message, self.status)


# -- replicas -------------------------------------------------------------------------------
class EngineReplica:
    """One kvloop engine as a Ray Serve replica (deployed by ``build_app``)."""

    def __init__(self, engine_args: EngineArgs, served_model_name: str,
                 max_queued_requests: int | None = None, threads: int | None = None) -> None:
        import prometheus_client
        import torch

        from kvloop.engine.llm_engine import LLMEngine
        from kvloop.server.async_engine import AsyncEngine
        from kvloop.server.metrics import ServerMetrics

        if threads:
            torch.set_num_threads(threads)
        prometheus_client.disable_created_metrics()
        self.engine = LLMEngine.from_args(engine_args)
        self.metrics = ServerMetrics(served_model_name, registry=CollectorRegistry())
        self.async_engine = AsyncEngine(self.engine, max_queued_requests=max_queued_requests,
                                        metrics=self.metrics)
        self.num_received = 0
        """Requests this replica was sent (the router subtracts it from what it routed)."""

    def _start(self) -> None:
        # NOTE: on the loop that runs ``generate``: the engine delivers outputs to it.
        if not self.async_engine.started:
            self.async_engine.start()

    async def describe(self) -> dict[str, Any]:
        """What the ingress needs to validate requests as this engine would."""
        return {"limits": self.engine.limits,
                "default_sampling": dict(self.engine.default_sampling),
                "block_size": self.engine.scheduler.cache_config.block_size,
                "num_gpu_blocks": self.engine.scheduler.cache_config.num_gpu_blocks}

    async def generate(self, routed: RoutedRequest
                       ) -> AsyncIterator[list[RequestOutput] | Failure]:
        """Run one request; yields its outputs in lists (each with every output queued by
        then: one Ray item per wake-up, not per token, when the loop falls behind), or
        ends with a ``Failure``."""
        self._start()
        self.num_received += 1
        eng = self.async_engine
        try:
            stream = eng.add_request(routed.request_id, routed.request,
                                     arrival_time=eng.clock() - routed.waited_s)
        except QueueFullError as exc:
            yield Failure("queue_full", str(exc), 429)
            return
        except EngineStoppedError as exc:
            yield Failure("stopped", str(exc), 503)
            return
        except InvalidRequestError as exc:
            yield Failure("invalid", exc.message, 400, exc.field)
            return
        try:
            async for out in stream:
                outs = [out]
                while stream.ready:
                    outs.append(await anext(stream))
                yield outs
        except RequestAbortedError as exc:
            yield Failure("aborted", str(exc), exc.status)
        except ValueError as exc:
            yield Failure("invalid", str(exc), 400)
        finally:
            stream.abort()  # NOTE: a no-op once finished; cancelled by the ingress: aborts

    def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Ray every ``ROUTING_STATS_PERIOD_S`` for ``KvloopRequestRouter``."""
        s = self.async_engine.stats
        return {"num_waiting": s.num_waiting, "num_running": s.num_running + s.num_swapped,
                "kv_usage": s.kv_usage, "num_received": self.num_received}

    async def metrics_text(self, target: ReplicaTarget) -> tuple[str, bytes]:
        """This replica's id and Prometheus exposition (sent here by the router:
        ``target``)."""
        return serve.get_replica_context().replica_id.unique_id, self.metrics.render()

    def check_health(self) -> None:
        """Ray's health check: the engine thread, once started, must be alive."""
        if self.async_engine.started and not self.async_engine.is_alive:
            raise RuntimeError("the engine thread is not running")

    def __del__(self) -> None:
        self.async_engine.shutdown()


# -- routing --------------------------------------------------------------------------------
_ROUTERS_IN_PROCESS: dict[str, KvloopRequestRouter] = {}
"""The request routers of this process by deployment name (the ingress reads replica ids
from its router for ``/metrics``); use ``_routers_in_process()``."""


def _routers_in_process() -> dict[str, KvloopRequestRouter]:
    # NOTE: through sys.modules: Ray unpickles the router class (and the ingress) by value,
    # each with its own copy of this module's globals; the imported module is the one
    # place they share.
    return sys.modules[__name__]._ROUTERS_IN_PROCESS


def _field(arg: Any, name: str) -> Any:
    """``arg.name`` or None. NOTE: by name, not ``isinstance``: Ray unpickles the router by
    value, so its ``RoutedRequest`` is another class object than the ingress's."""
    return getattr(arg, name, None)


class KvloopRequestRouter(RequestRouter):
    """Ray Serve's request router around a kvloop ``Router`` (``request_router_kwargs``:
    ``router`` name and the router's own options)."""

    def initialize_state(self, router: str = "round-robin", **kwargs: Any) -> None:
        self.policy = make_router(router, **kwargs)
        self._routed: dict[str, int] = {}
        """Requests routed to each replica (compared with its ``num_received``)."""
        self._ongoing: dict[str, int] = {}
        """Requests routed to each replica and not completed."""
        _routers_in_process()[self._deployment_id.name] = self

    def _load(self, replica: RunningReplica) -> ReplicaLoad:
        rid = replica.replica_id.unique_id
        stats = replica.routing_stats or {}
        waiting = int(stats.get("num_waiting", 0))
        running = int(stats.get("num_running", 0))
        # NOTE: stats are up to a period old: requests routed since then (routed - received)
        # count as waiting; completions since then lower the ongoing count first.
        waiting += max(0, self._routed.get(rid, 0) - int(stats.get("num_received", 0)))
        total = min(waiting + running, self._ongoing.get(rid, 0)) if rid in self._ongoing \
            else waiting + running
        return ReplicaLoad(num_waiting=max(0, total - running),
                           num_running=min(running, total),
                           kv_usage=float(stats.get("kv_usage", 0.0)))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        arg = pending_request.args[0] if pending_request and pending_request.args else None
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        target = _field(arg, "replica")
        if target is not None:
            # NOTE: a target gone meanwhile gets any replica (an empty answer makes Ray's
            # router spin); the replica names itself and the ingress drops a stray answer.
            return [[by_id[target]]] if target in by_id else [candidate_replicas]
        route = _field(arg, "route") or RouteRequest("")
        ranked = self.policy.rank(route, {rid: self._load(r) for rid, r in by_id.items()})
        return [[by_id[ranked[0]]], [by_id[r] for r in ranked[1:]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        route = _field(pending_request.args[0] if pending_request.args else None, "route")
        if route is None:
            return
        rid = replica_id.unique_id
        self._routed[rid] = self._routed.get(rid, 0) + 1
        self._ongoing[rid] = self._ongoing.get(rid, 0) + 1
        self.policy.on_routed(route, rid)
        # NOTE: a callback of our own on this very result, not on_request_completed: Ray
        # calls that for every call (/metrics ones too, which would lower the count), and
        # can call it before this method when a replica answers at once. Ray fires it once,
        # from another thread, also when the result is already done.
        loop = self._event_loop
        result.add_done_callback(lambda _: loop.call_soon_threadsafe(self._completed, rid))

    def _completed(self, rid: str) -> None:
        """A request routed to ``rid`` completed (a replica gone meanwhile: nothing left)."""
        if self._ongoing.get(rid, 0) > 0:
            self._ongoing[rid] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        rid = replica_id.unique_id
        self.policy.on_replica_removed(rid)
        self._routed.pop(rid, None)
        self._ongoing.pop(rid, None)

    @property
    def replica_ids(self) -> list[str]:
        """The replicas this router currently routes to."""
        return sorted(r.unique_id for r in self.curr_replicas)


# -- the ingress ----------------------------------------------------------------------------
@dataclass
class ClusterEngine:
    """The ``AsyncEngine`` surface the HTTP layer uses, over a deployment handle: each
    request is routed to a replica and its outputs are pumped into a ``RequestStream``."""

    handle: Any
    """A ``DeploymentHandle`` to the engine replicas."""
    limits: EngineLimits
    """What every request must fit (the replicas' own, from ``describe``)."""
    tokenizer: Any | None
    """The model's tokenizer (None: token ids only)."""
    default_sampling: dict[str, Any]
    """The replicas' sampling defaults."""
    block_size: int
    """The replicas' KV block size (the prefix hashes that route requests)."""
    clock: Callable[[], float] = time.monotonic
    draining: bool = False
    _tasks: dict[str, asyncio.Task] = field(default_factory=dict)
    _alive: bool = False

    def start(self) -> None:
        self._alive = True

    def shutdown(self, timeout: float = 10.0) -> None:
        self._alive = False
        for task in list(self._tasks.values()):
            task.get_loop().call_soon_threadsafe(task.cancel)

    @property
    def is_alive(self) -> bool:
        return self._alive

    @property
    def num_active(self) -> int:
        return len(self._tasks)

    def add_request(self, request_id: str, request: ValidatedRequest, *,
                    arrival_time: float | None = None) -> RequestStream:
        """Send ``request`` to a replica; errors arrive through the stream."""
        if self.draining or not self._alive:
            raise EngineStoppedError("the server is draining (shutting down)" if self.draining
                                     else "the engine is not running")
        if request_id in self._tasks:
            raise InvalidRequestError("request_id", f"request_id {request_id!r} is already "
                                      "in use")
        now = self.clock()
        waited = now - arrival_time if arrival_time is not None else 0.0
        stream = RequestStream(request_id, self.abort, request.params.n)
        # NOTE: bounded work on the event loop: at most MAX_ROUTED_BLOCKS hashes.
        route = route_request(request_id, request.prompt_token_ids, self.block_size,
                              request.cache_salt)
        routed = RoutedRequest(request_id, request, waited, route)
        self._tasks[request_id] = asyncio.ensure_future(self._pump(stream, routed))
        return stream

    async def _pump(self, stream: RequestStream, routed: RoutedRequest) -> None:
        gen = self.handle.options(stream=True).generate.remote(routed)
        ended = False
        try:
            # NOTE: read to the generator's end (the replica returns after the last output),
            # so that Ray sees the call complete and the replica's slot is released.
            async for item in gen:
                if ended:
                    continue
                if _field(item, "kind") is not None:  # a Failure
                    stream.put(item.exception())
                    ended = True
                    continue
                for out in item:
                    ended = stream.put(out)
            if not ended:
                stream.put(RequestAbortedError("the replica ended the stream early", 500))
        except asyncio.CancelledError:
            gen.cancel()  # NOTE: cancels the replica's generator, which aborts the request
            raise
        except Exception as exc:
            logger.exception("replica call failed for %s", routed.request_id)
            stream.put(RequestAbortedError(f"replica failed: {type(exc).__name__}", 500))
        finally:
            self._tasks.pop(routed.request_id, None)

    def abort(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    def abort_all(self) -> None:
        for rid in list(self._tasks):
            self.abort(rid)


async def merged_metrics(handle: Any) -> bytes:
    """Every replica's ``/metrics``, each series labelled with its ``replica``."""
    router = _routers_in_process().get(ENGINE_DEPLOYMENT)
    ids = router.replica_ids if router is not None else []
    families: dict[str, Any] = {}
    for rid in ids:
        # NOTE: one call at a time: calls made while serving one HTTP request share Ray's
        # internal request id, and Ray's router matches concurrent ones to replicas by it.
        try:
            who, text = await asyncio.wait_for(
                handle.metrics_text.remote(ReplicaTarget(rid)), METRICS_TIMEOUT_S)
        except Exception as exc:
            logger.warning("replica %s gave no metrics: %r", rid, exc)
            continue
        if who != rid:
            continue
        for fam in text_string_to_metric_families(text.decode()):
            merged = families.setdefault(fam.name, fam)
            labelled = [s._replace(labels={**s.labels, "replica": rid}) for s in fam.samples]
            if merged is fam:
                fam.samples = labelled
            else:
                merged.samples.extend(labelled)

    class _Merged:
        def collect(self) -> Any:
            return iter(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)


class Ingress:
    """The OpenAI-compatible ingress deployment (one replica, no model weights)."""

    def __init__(self, engines: Any, engine_args: EngineArgs, server_config: Any) -> None:
        self.engines = engines
        self.engine_args = engine_args
        self.server_config = server_config

    async def __serve_build_asgi_app__(self) -> Any:
        from kvloop.engine.generation_config import default_sampling_fields
        from kvloop.engine.model_source import resolve_model
        from kvloop.engine.tokenizer import Tokenizer
        from kvloop.server.app import create_app
        from kvloop.server.metrics import ServerMetrics

        info = await self.engines.describe.remote()
        args = self.engine_args
        path = resolve_model(args.model)
        tokenizer = None if args.skip_tokenizer_init else Tokenizer(path)
        self.engine = engine = ClusterEngine(self.engines, info["limits"], tokenizer,
                                             info["default_sampling"] or
                                             default_sampling_fields(
                                                 args.generation_config, path,
                                                 model=args.model),
                                             info["block_size"])
        handle = self.engines

        async def render() -> bytes:
            return await merged_metrics(handle)

        return create_app(engine, ServerMetrics(self.server_config.served_model_name),
                          self.server_config, render_metrics=render)


    async def drain(self, timeout: float) -> int:
        """Refuse new requests (503, ``/health`` too) and wait up to ``timeout`` seconds for
        those in flight to finish; returns how many were still running (then aborted)."""
        engine = self.engine
        engine.draining = True
        deadline = time.monotonic() + timeout
        while engine.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        left = engine.num_active
        engine.abort_all()
        return left


def replica_count(engine_args: EngineArgs, replicas: int,
                  max_replicas: int | None) -> dict[str, Any]:
    """The deployment's replica options: ``num_replicas``, or, with ``max_replicas`` above
    ``replicas``, Ray Serve's autoscaling between the two, starting at ``replicas``.

    NOTE: the autoscaling target is ``max_num_seqs`` ongoing requests per replica: Ray adds a
    replica once the replicas' average would have to queue (every running slot taken), and
    removes one when they run well under it."""
    if max_replicas is None or max_replicas == replicas:
        return {"num_replicas": replicas}
    return {"autoscaling_config": {
        "min_replicas": replicas, "initial_replicas": replicas, "max_replicas": max_replicas,
        "target_ongoing_requests": engine_args.max_num_seqs}}


def build_app(engine_args: EngineArgs, server_config: Any, *, replicas: int,
              router: str = "kv-aware", threads: int | None = None,
              num_gpus_per_replica: float = 0.0, max_queued_requests: int | None = None,
              router_kwargs: dict[str, Any] | None = None,
              max_replicas: int | None = None) -> Any:
    """The Serve application: ``replicas`` engines behind one ingress, routed by ``router``
    (autoscaled up to ``max_replicas`` when given: ``replica_count``).

    On CPU each replica reserves ``threads`` CPUs (its torch threads); with GPUs, each one
    ``num_gpus_per_replica``."""
    make_router(router)  # NOTE: an unknown name fails here, before any actor starts
    actor: dict[str, Any] = {"num_cpus": threads or 1}
    if num_gpus_per_replica:
        actor["num_gpus"] = num_gpus_per_replica
    engines = serve.deployment(
        EngineReplica,
        name=ENGINE_DEPLOYMENT,
        **replica_count(engine_args, replicas, max_replicas),
        ray_actor_options=actor,
        max_ongoing_requests=MAX_ONGOING_REQUESTS,
        health_check_period_s=5,
        max_constructor_retry_count=2,
        request_router_config=RequestRouterConfig(
            request_router_class=KvloopRequestRouter,
            request_router_kwargs={"router": router, **(router_kwargs or {})},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=5,
        ),
    ).bind(engine_args, server_config.served_model_name, max_queued_requests, threads)
    # NOTE: wrapped here, not with a decorator: Ray pickles the wrapper by value, and this
    # module's functions must stay importable (by reference) for the router registry.
    ingress = serve.deployment(serve.ingress()(Ingress), name=INGRESS_DEPLOYMENT, num_replicas=1,
                               ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=4 * MAX_ONGOING_REQUESTS)
    return ingress.bind(engines, engine_args, server_config)
