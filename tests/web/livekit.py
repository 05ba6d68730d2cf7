"""A live server with the dashboard: the tiny model of the server tests, in this process."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import uvicorn

from kvloop.engine.args import EngineArgs
from kvloop.engine.llm_engine import LLMEngine
from kvloop.server.app import ServerConfig, create_app
from kvloop.server.async_engine import AsyncEngine
from kvloop.server.dashboard import LiveRecorder, install_dashboard
from kvloop.server.metrics import ServerMetrics
from kvloop.viz.web.live import dashboard_parts
from server.serverkit import ENGINE_ARGS, MODEL_NAME

SMALL_POOL = {**ENGINE_ARGS, "num_gpu_blocks": 12, "max_num_seqs": 8,
              "cost_aware_preemption": False}
"""12 blocks of 16 tokens: a few concurrent requests run out of KV blocks."""


@dataclass
class DashboardServer:
    url: str
    server: uvicorn.Server
    thread: threading.Thread
    recorder: LiveRecorder

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def start(model: Path, *, api_key: str | None = None, show_prompts: bool = False,
          **engine_args: Any) -> DashboardServer:
    """Serve ``model`` with a dashboard on a free loopback port."""
    recorder = LiveRecorder()
    engine = LLMEngine.from_args(EngineArgs(model=str(model), **{**SMALL_POOL, **engine_args}),
                                 recorder=recorder)
    metrics = ServerMetrics(MODEL_NAME)
    aengine = AsyncEngine(engine, metrics=metrics)
    app = create_app(aengine, metrics, ServerConfig(MODEL_NAME, str(model), api_key, 0))
    install_dashboard(app, recorder, **dashboard_parts(), api_key=api_key, source="test",
                      engine=aengine, show_prompts=show_prompts)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the dashboard test server did not start")
        time.sleep(0.01)
    return DashboardServer(f"http://127.0.0.1:{port}", server, thread, recorder)
