"""``kvloop serve --replicas N``: N engine replicas on Ray Serve behind one ingress.

Without ``--ray-address`` a local Ray starts for the server and stops with it; with one,
the application joins that cluster and only the application is deleted on exit. The
routes, validation, streaming, errors and API key are ``kvloop serve``'s own
(``kvloop.cluster.ray_serve``)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from typing import Any

from kvloop.cluster.routers import DEFAULT_ROUTER, ROUTERS, check_router

APP_NAME = "kvloop"


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """The replica flags of ``kvloop serve``."""
    g = p.add_argument_group("replicas (Ray Serve)")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="serve N engine replicas on Ray Serve behind one endpoint "
                   "(default: one engine in this process, no Ray)")
    g.add_argument("--max-replicas", type=int, default=None, metavar="M",
                   help="autoscale between --replicas and M replicas with Ray Serve's "
                   "autoscaler (target: --max-num-seqs ongoing requests per replica) "
                   "(default: a fixed --replicas)")
    g.add_argument("--router", default=DEFAULT_ROUTER, metavar="NAME",
                   help=f"how requests are spread over the replicas: {', '.join(ROUTERS)} "
                   "(kv-aware: the replica holding most of the prompt's leading KV blocks, "
                   "minus a load penalty) (default: %(default)s)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (e.g. ray://head:10001 or auto) instead of "
                   "starting a local one (default: a local Ray for this server)")
    g.add_argument("--num-gpus-per-replica", type=float, default=0.0,
                   help="GPUs each replica reserves (default: 0, CPU)")
    g.add_argument("--threads-per-replica", type=int, default=None,
                   help="CPU threads (and Ray CPUs) per replica (default: the CPUs of this "
                   "machine divided by --replicas, at least 1)")


def check_cluster_args(args: argparse.Namespace) -> None:
    """``ValueError`` naming the flag for a bad replica setting."""
    check_router(args.router, "--router")
    if args.replicas is None:
        return
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.max_replicas is not None and args.max_replicas < args.replicas:
        raise ValueError(f"--max-replicas must be >= --replicas ({args.replicas}), got "
                         f"{args.max_replicas}")
    if args.threads_per_replica is not None and args.threads_per_replica < 1:
        raise ValueError(f"--threads-per-replica must be >= 1, got {args.threads_per_replica}")
    if args.num_gpus_per_replica < 0:
        raise ValueError("--num-gpus-per-replica must be >= 0")
    if args.trace_out:
        raise ValueError("--trace-out records one engine's steps: not with --replicas")


def check_resources(args: argparse.Namespace, threads: int, *, local: bool = False) -> None:
    """``ValueError`` when the Ray cluster cannot place the replicas at all (Ray would wait
    for them forever). A local Ray has this machine's CPUs and never grows: replicas that
    would oversubscribe them, ``--max-replicas`` included, are refused too."""
    import ray

    have = ray.cluster_resources()
    count, flag = args.replicas, "--replicas"
    if local and args.max_replicas is not None:
        count, flag = args.max_replicas, "--max-replicas"
    need = {"GPU": args.num_gpus_per_replica * count,
            "CPU": 0.0 if args.num_gpus_per_replica else float(threads * count)}
    for kind, amount in need.items():
        if amount > have.get(kind, 0.0):
            per = "--num-gpus-per-replica" if kind == "GPU" else "--threads-per-replica"
            raise ValueError(f"{count} replicas need {amount:g} {kind}s but the Ray "
                             f"cluster has {have.get(kind, 0.0):g}: lower {flag} or {per}")


def check_serve_http(args: argparse.Namespace) -> None:
    """``ValueError`` when Ray Serve already runs on the joined cluster with another host or
    port: Ray would keep its proxy there and ignore ``--host``/``--port`` silently."""
    try:
        from ray.serve.context import _get_global_client

        client = _get_global_client(raise_if_no_controller_running=False)
        config = client.http_config if client is not None else None
    except (ImportError, AttributeError):  # NOTE: a private API; without it, no check
        return
    if config is not None and (config.host, config.port) != (args.host, args.port):
        raise ValueError(f"Ray Serve already runs on that cluster at {config.host}:"
                         f"{config.port} and would ignore --host {args.host} --port "
                         f"{args.port}: pass --host {config.host} --port {config.port}, or "
                         "stop it first (serve shutdown)")


def run_replicas(args: argparse.Namespace, engine_args: Any, server_config: Any) -> int:
    """Start Ray (or join ``--ray-address``), deploy, print one line, wait for a signal."""
    import ray
    from ray import serve

    from kvloop.cluster.ray_serve import build_app
    from kvloop.engine.model_source import resolve_model

    # NOTE: before Ray starts: a bad --model is one line here, not N replica constructors
    # failing and retried; a GGUF is converted once, not by every replica at the same time.
    resolve_model(engine_args.model)
    cpus = os.cpu_count() or 1
    most = args.max_replicas or args.replicas
    threads = args.threads_per_replica or max(1, cpus // most)
    started_ray = args.ray_address is None
    if started_ray:
        # NOTE: address "local": a Ray of our own even when `ray start` runs on this machine
        # (plain ray.init would join that one and refuse num_cpus). Its CPUs are this
        # machine's, so replicas that would oversubscribe them are refused (check_resources).
        ray.init(address="local", num_cpus=cpus, include_dashboard=False)
    else:
        ray.init(address=args.ray_address)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    serve_started = False
    try:
        check_resources(args, threads, local=started_ray)
        if not started_ray:
            check_serve_http(args)
        serve.start(http_options={"host": args.host, "port": args.port})
        serve_started = True
        app = build_app(engine_args, server_config, replicas=args.replicas,
                        router=args.router, threads=threads,
                        num_gpus_per_replica=args.num_gpus_per_replica,
                        max_queued_requests=args.max_queued_requests,
                        max_replicas=args.max_replicas)
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        host = f"[{args.host}]" if ":" in args.host else args.host
        where = "a local Ray" if started_ray else f"Ray at {args.ray_address}"
        unit = (f"{args.num_gpus_per_replica:g} GPU" if args.num_gpus_per_replica
                else f"{threads} thread{'s' * (threads > 1)}")
        count = (f"{args.replicas} replicas" if not args.max_replicas
                 or args.max_replicas == args.replicas
                 else f"{args.replicas}-{args.max_replicas} replicas (autoscaled)")
        print(f"kvloop serve: {count} of {engine_args.model} ({unit} each) "
              f"on {where}, router {args.router}; http://{host}:{args.port}",
              file=sys.stderr, flush=True)
        stop.wait()
        # NOTE: as a single `kvloop serve`: 503 to new requests, running ones finish.
        left = serve.get_app_handle(APP_NAME).drain.remote(args.shutdown_timeout).result(
            timeout_s=args.shutdown_timeout + 30)
        aborted = f" ({left} request{'s' if left != 1 else ''} aborted)" if left else ""
        print(f"kvloop serve: stopped{aborted}", file=sys.stderr, flush=True)
    finally:
        # NOTE: a failed cleanup must not hide why the server stopped (a refused flag).
        with contextlib.suppress(Exception):
            if serve_started:
                serve.delete(APP_NAME) if not started_ray else serve.shutdown()
        ray.shutdown()
    return 0
