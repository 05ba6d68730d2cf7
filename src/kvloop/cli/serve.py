"""``kvloop serve``: the OpenAI-compatible server on uvicorn, with a graceful drain
(``server/draining.py``) on SIGTERM/SIGINT.

Before the model loads, the address is checked (``check_address``: a taken port is a one-line
error, not a failure after a minute of loading); once it has loaded, one line on stderr says
what is served and how (``startup_line``)."""

from __future__ import annotations

import argparse
import errno
import logging
import signal
import socket
import sys
import threading
from typing import IO, Any

from kvloop.cli.args import add_model_args, engine_args_from, format_size
from kvloop.cli.serve_ray import add_cluster_args, check_cluster_args, run_replicas
from kvloop.cli.status import status_to_stderr
from kvloop.server import DEFAULT_MAX_REQUEST_BYTES
from kvloop.server.limits import BODY_MIN_RATE, ConnectionLimits

LIMITS = ConnectionLimits()
"""The connection limits' defaults."""

RESPONSE_FLUSH_S = 5
"""After the drain, how long uvicorn may take to send the last responses."""
GIL_SWITCH_S = 0.001
"""``sys.setswitchinterval`` of the server process (Python's default: 0.005): a stream's
longest gap under a flood of long prompts 26-29 ms against 29-99 ms, and 2-5 % more output
tokens/s at 32 streams (2-core Xeon, measured 2026-12-05)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible API",
        description="Serve /v1/completions, /v1/chat/completions and /metrics over kvloop's "
        "engine (default model: the embedded SmolLM2-135M-Instruct).",
    )
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the --model value)")
    g.add_argument("--max-queued-requests", type=int, default=None,
                   help="answer 429 while this many requests wait (default: no limit)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on /v1/* (any path or method: "
                   "401 without it) (default: none, no key)")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="answer 413 to a request body larger than this, before reading it "
                   f"(default: {DEFAULT_MAX_REQUEST_BYTES} = 1 MiB, as nginx; 0: no limit)")
    g.add_argument("--max-header-bytes", type=int, default=LIMITS.max_header_bytes,
                   help="answer 431 to request headers larger than this, and close the "
                   f"connection (default: {LIMITS.max_header_bytes} = 64 KiB)")
    g.add_argument("--header-timeout", type=float, default=LIMITS.header_timeout_s,
                   help="seconds a client may take to send its request headers, else 408 "
                   f"and close (default: {LIMITS.header_timeout_s:g})")
    g.add_argument("--body-timeout", type=float, default=LIMITS.body_timeout_s,
                   help="seconds a client may take to send its request body, plus one per "
                   f"{BODY_MIN_RATE} bytes sent, else 408 and close (default: "
                   f"{LIMITS.body_timeout_s:g})")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests may take to finish after SIGTERM/SIGINT")
    g.add_argument("--trace-out", default=None,
                   help="write every step record to this JSONL (default: none)")
    g.add_argument("--no-dashboard", action="store_true",
                   help="no live web view at /dashboard (and no step records kept for it)")
    g.add_argument("--dashboard-show-prompts", action="store_true",
                   help="show request prompts in /dashboard (default: ids and counts only)")
    g.add_argument("--log-interval", type=float, default=10.0,
                   help="seconds between stats lines (0: none)")
    g.add_argument("--disable-uvicorn-access-log", action="store_true")
    add_cluster_args(p)
    add_model_args(p)
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> ConnectionLimits:
    """Check the server flags (``ValueError`` naming one); the connection limits."""
    if args.max_queued_requests is not None and args.max_queued_requests < 1:
        raise ValueError("--max-queued-requests must be >= 1")
    if args.shutdown_timeout < 0:
        raise ValueError("--shutdown-timeout must be >= 0")
    if not 0 <= args.port <= 65535:
        raise ValueError("--port must be in [0, 65535]")
    if args.log_interval < 0:
        raise ValueError("--log-interval must be >= 0")
    if args.max_request_bytes < 0:
        raise ValueError("--max-request-bytes must be >= 0 (0: no limit)")
    limits = connection_limits(args)
    if args.replicas is not None and limits != LIMITS:
        raise ValueError("--max-header-bytes, --header-timeout and --body-timeout limit kvloop "
                         "serve's own HTTP server; with --replicas requests go through Ray "
                         "Serve's proxy, which has its own")
    return limits


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    """The ``--max-header-bytes``, ``--header-timeout`` and ``--body-timeout`` limits
    (``ValueError`` naming the flag)."""
    return ConnectionLimits(args.max_header_bytes, args.header_timeout, args.body_timeout)


def check_address(host: str, port: int) -> int:
    """Bind ``host:port`` for a moment (every address ``host`` resolves to, with the options
    uvicorn's listener uses) and return the port to serve on: ``port``, or a free one for 0.

    Raises ``ValueError`` with one line when the host does not resolve or the port is taken
    or not allowed."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"cannot serve on --host {host!r}: {exc.strerror}") from None
    chosen = port
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as sock:
            # NOTE: as asyncio's create_server: a port in TIME_WAIT is free, a listening one
            # is not; IPv6 sockets do not claim the IPv4 port too.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((addr[0], chosen, *addr[2:]))
            except OSError as exc:
                where = f"{_url_host(host)}:{chosen}"
                if exc.errno == errno.EADDRINUSE:
                    raise ValueError(f"cannot serve on {where}: the port is in use (another "
                                     "server?); choose another --port") from None
                raise ValueError(f"cannot serve on {where}: {exc.strerror}") from None
            chosen = chosen or sock.getsockname()[1]
    return chosen


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def startup_line(engine: Any, model: str, url: str) -> str:
    """The one line ``kvloop serve`` prints once it is ready: the model, device and dtype,
    the KV blocks and their memory, the token budget, the context length, the scheduling
    policy unless it is ``fcfs`` (``policy_note``) and the URL. Whose kernels run and why
    the budget is what it is are on the start-up lines before it."""
    runner = engine.executor
    cache = engine.scheduler.cache_config
    blocks, size = cache.num_gpu_blocks, cache.block_size
    device = getattr(runner, "device", None)
    dtype = getattr(runner, "precision", None) or str(getattr(runner, "dtype", "")).removeprefix(
        "torch.")
    where = f" on {device} ({dtype})" if device is not None else ""
    pool = getattr(getattr(runner, "kv_cache", None), "gpu", None)
    memory = f", {format_size(pool.nbytes)}" if pool is not None else ""
    swap = f" + {cache.num_cpu_blocks} swap blocks" if cache.num_cpu_blocks else ""
    budget = engine.scheduler.config.max_num_batched_tokens
    return (f"kvloop serve: model {model}{where}; KV cache {blocks} blocks x {size} tokens = "
            f"{blocks * size} tokens{memory}{swap}; token budget {budget} tokens per step; "
            f"max_model_len {engine.limits.max_model_len}; "
            f"{policy_note(engine.scheduler.config)}{url}")


def policy_note(config: Any) -> str:
    """``"scheduling policy slo (TTFT 0.5 s, ...); "`` for a ``SchedulerConfig`` whose
    policy is not the default ``fcfs``, with the settings that shape it; empty for fcfs."""
    policy = getattr(config, "policy", "fcfs")
    if policy == "fcfs":
        return ""
    parts = []
    if config.slo_ttft is not None:
        parts.append(f"TTFT target {config.slo_ttft:g} s")
    if config.slo_tpot is not None:
        parts.append(f"TPOT target {config.slo_tpot:g} s")
    if policy == "slo":
        parts.append(f"overload {config.slo_overload}")
    if policy in ("priority", "slo") and config.aging_s:
        parts.append(f"aging {config.aging_s:g} s")
    if policy == "fair" and config.tenant_weights:
        parts.append("weights " + ",".join(f"{t}={w:g}" for t, w in config.tenant_weights))
    if not config.cost_aware_preemption:
        parts.append("newest-first preemption")
    return f"scheduling policy {policy}" + (f" ({', '.join(parts)})" if parts else "") + "; "


def run(args: argparse.Namespace) -> int:
    import prometheus_client
    import uvicorn

    from kvloop.core.stats import StepRecorder
    from kvloop.engine.llm_engine import LLMEngine
    from kvloop.server.app import ServerConfig, create_app
    from kvloop.server.async_engine import AsyncEngine
    from kvloop.server.connection import protocol_class
    from kvloop.server.dashboard import LiveRecorder, install_dashboard
    from kvloop.server.draining import DrainingServer
    from kvloop.server.metrics import ServerMetrics
    from kvloop.viz.web.live import dashboard_parts

    limits = _check(args)
    check_cluster_args(args)
    port = check_address(args.host, args.port)
    if args.replicas is not None:
        # NOTE: the ingress's own stats line would only see zeros: replicas report through
        # ``/metrics``.
        config = ServerConfig(args.served_model_name or args.model, args.model, args.api_key,
                              0, max_request_bytes=args.max_request_bytes)
        args.port = port
        return run_replicas(args, engine_args_from(args), config)
    # NOTE: process-wide, so only here: no ``*_created`` series next to the counters.
    prometheus_client.disable_created_metrics()
    # NOTE: process-wide too. The engine thread gives up the GIL at every torch op and waits
    # up to the switch interval to get it back while the event loop or a prompt worker runs
    # Python: at the default 5 ms, a flood of 600 KB prompts put 100 ms gaps in a stream.
    sys.setswitchinterval(GIL_SWITCH_S)
    logging.basicConfig(level=logging.INFO,
                        format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    trace: IO[str] | None = None
    try:
        recorder: StepRecorder | None = None
        if args.trace_out:
            trace = open(args.trace_out, "w", buffering=1, encoding="utf-8")  # noqa: SIM115
            recorder = StepRecorder(keep_in_memory=False, sink=trace)
        if not args.no_dashboard:
            recorder = LiveRecorder(sink=trace)
        with status_to_stderr():  # NOTE: the phase lines, as kvloop generate prints them
            engine = LLMEngine.from_args(engine_args_from(args), recorder=recorder)
        name = args.served_model_name or args.model
        model = args.model if name == args.model else f"{args.model} (served as {name})"
        metrics = ServerMetrics(name)
        async_engine = AsyncEngine(engine, max_queued_requests=args.max_queued_requests,
                                   metrics=metrics, on_caller_thread=True)
        tok = engine.tokenizer
        config = ServerConfig(name, str(getattr(tok, "path", args.model)), args.api_key,
                              args.log_interval, max_request_bytes=args.max_request_bytes)
        app = create_app(async_engine, metrics, config)
        if isinstance(recorder, LiveRecorder):
            install_dashboard(app, recorder, **dashboard_parts(), api_key=args.api_key,
                              source=f"kvloop serve {name}", engine=async_engine,
                              show_prompts=args.dashboard_show_prompts)
        server = DrainingServer(
            uvicorn.Config(app, host=args.host, port=port, log_level="info",
                           access_log=not args.disable_uvicorn_access_log,
                           timeout_graceful_shutdown=RESPONSE_FLUSH_S,
                           http=protocol_class(limits)),
            async_engine, args.shutdown_timeout,
        )
        url = f"http://{_url_host(args.host)}:{port}"
        print(startup_line(engine, model, url), file=sys.stderr, flush=True)
        if not args.no_dashboard:
            print(f"kvloop: the loop, live, at {url}/dashboard", file=sys.stderr, flush=True)
        # NOTE: the engine loop runs on this (main) thread, uvicorn's event loop on another
        # (``AsyncEngine.run_here`` says why); uvicorn installs no signal handlers off the
        # main thread, so the drain's are installed here.
        http = threading.Thread(target=server.run, name="kvloop-http")
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, server.handle_exit)
        http.start()
        async_engine.run_here(wait_while=http.is_alive)
        while http.is_alive():  # NOTE: bounded waits, so a second signal is still handled
            http.join(0.1)
        if not server.started:
            return 1
        n = server.aborted
        aborted = f" ({n} request{'s' if n != 1 else ''} aborted)" if n else ""
        print(f"kvloop serve: stopped{aborted}", file=sys.stderr, flush=True)
        if server.forced:
            return 130
    finally:
        if trace is not None:
            trace.close()
    return 0
