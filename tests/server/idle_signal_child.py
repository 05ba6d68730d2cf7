"""Child process of ``test_idle_signals.py``: a server laid out as ``kvloop serve`` lays it
out (uvicorn on a thread, the engine loop on the main thread, where Python runs signal
handlers) over the tiny test model, whose SIGTERM handler only writes ``handled`` to stdout.
It prints ``port N`` once it listens; the parent then sends SIGTERM as each request ends.

Usage: ``python idle_signal_child.py MODEL_FOLDER``."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading

import uvicorn

from kvloop.engine.args import EngineArgs
from kvloop.engine.llm_engine import LLMEngine
from kvloop.server.app import ServerConfig, create_app
from kvloop.server.async_engine import AsyncEngine
from kvloop.server.metrics import ServerMetrics


def main(model: str) -> None:
    engine = LLMEngine.from_args(EngineArgs(model=model, dtype="float32", device="cpu",
                                            num_gpu_blocks=64, swap_space=0.0,
                                            max_model_len=256))
    aengine = AsyncEngine(engine, on_caller_thread=True)
    app = create_app(aengine, ServerMetrics("tiny"), ServerConfig("tiny", log_interval=0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    signal.signal(signal.SIGTERM, lambda *_: os.write(1, b"handled\n"))
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    http.start()
    os.write(1, f"port {sock.getsockname()[1]}\n".encode())
    aengine.run_here(wait_while=http.is_alive)


if __name__ == "__main__":
    main(sys.argv[1])
