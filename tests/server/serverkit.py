"""Live servers for the server tests: a tiny random-weight Llama with a tiny BPE tokenizer,
served by a real uvicorn on a free loopback port (in a thread, or as a subprocess).

A plain module (not conftest) so that tests can import its helpers by name."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")

import uvicorn  # noqa: E402

from kvloop.engine.args import EngineArgs  # noqa: E402
from kvloop.engine.llm_engine import LLMEngine  # noqa: E402
from kvloop.server.app import ServerConfig, create_app  # noqa: E402
from kvloop.server.async_engine import AsyncEngine  # noqa: E402
from kvloop.server.connection import protocol_class  # noqa: E402
from kvloop.server.draining import DrainingServer  # noqa: E402
from kvloop.server.limits import ConnectionLimits  # noqa: E402
from kvloop.server.metrics import ServerMetrics  # noqa: E402

MODEL_NAME = "tiny-llama"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = (
    "the quick brown fox jumps over the lazy dog while a small server streams tokens to many "
    "clients; every request waits in a queue, gets scheduled, fills its cache blocks and "
    "returns text. hello world, how are you today? numbers 0123456789 and more words: paged "
    "attention, prefix caching, chunked prefill, preemption, swapping, metrics and latency."
)
ENGINE_ARGS = {
    "dtype": "float32",
    "device": "cpu",
    "block_size": 16,
    "num_gpu_blocks": 128,
    "swap_space": 0.0,
    "max_model_len": 256,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 512,
}


def build_tiny_model(root: Path) -> Path:
    """Save a tiny byte-level BPE tokenizer (with a chat template) and a random Llama."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(root)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(fast),
        max_position_embeddings=256,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(root)
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    """A running server: its URL, app, engines and the uvicorn server object."""

    url: str
    engine: LLMEngine
    async_engine: AsyncEngine
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def app(self) -> Any:
        """The FastAPI app (its ``state`` holds ``serving`` and ``prompt_workers``)."""
        return self.server.config.app

    @property
    def serving(self) -> Any:
        """The app's ``OpenAIServing`` (test hooks swap its ``tokenizer``)."""
        return self.app.state.serving

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples by name (labels dropped but ``finished_reason``)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                reason = s.labels.get("finished_reason")
                out[f"{s.name}{{{reason}}}" if reason else s.name] = s.value
        return out

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Poll /metrics until nothing runs or waits and the KV cache is empty."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (
                m["kvloop:num_requests_running"] == 0
                and m["kvloop:num_requests_waiting"] == 0
                and m["kvloop:kv_cache_usage_perc"] == 0
            )
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def start_server(model_path: Path, *, api_key: str | None = None,
                 max_queued_requests: int | None = None, shutdown_timeout: float = 30.0,
                 server_config: dict[str, Any] | None = None,
                 connection_limits: ConnectionLimits | None = None,
                 **engine_args: Any) -> LiveServer:
    """Serve the tiny model in this process: uvicorn on a background thread, with
    ``kvloop serve``'s connection limits (``connection_limits``, default: its defaults).

    ``server_config``: more ``ServerConfig`` fields (``max_request_bytes``, ...)."""
    args = EngineArgs(model=str(model_path), **{**ENGINE_ARGS, **engine_args})
    engine = LLMEngine.from_args(args)
    metrics = ServerMetrics(MODEL_NAME)
    aengine = AsyncEngine(engine, max_queued_requests=max_queued_requests, metrics=metrics)
    config = ServerConfig(MODEL_NAME, str(model_path), api_key, 0, **(server_config or {}))
    app = create_app(aengine, metrics, config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = DrainingServer(
        uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5,
                       http=protocol_class(connection_limits or ConnectionLimits())),
        aengine, shutdown_timeout)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    return LiveServer(f"http://127.0.0.1:{port}", engine, aengine, server, thread)


@contextlib.contextmanager
def server_factory(model_path: Path, check: Callable[[LiveServer], None] | None = None
                   ) -> Iterator[Callable[..., LiveServer]]:
    """Start extra in-process servers of ``model_path`` on demand; on leaving, ``check``
    each one (if given), then stop them all."""
    started: list[LiveServer] = []

    def make(**kwargs: Any) -> LiveServer:
        live = start_server(model_path, **kwargs)
        started.append(live)
        return live

    try:
        yield make
        for live in started:
            if check is not None:
                check(live)
    finally:
        for live in started:
            live.stop()


@contextlib.contextmanager
def patched_execute(engine: LLMEngine, wrapper: Callable[[Callable], Callable]) -> Iterator[None]:
    """Wrap the engine's ``executor.execute`` for the duration of a block."""
    original = engine.executor.execute
    engine.executor.execute = wrapper(original)  # type: ignore[method-assign]
    try:
        yield
    finally:
        engine.executor.execute = original  # type: ignore[method-assign]


def slow_steps(delay: float) -> Callable[[Callable], Callable]:
    def wrap(execute: Callable) -> Callable:
        def slow(out: Any) -> Any:
            time.sleep(delay)
            return execute(out)

        return slow

    return wrap


@dataclass
class ServerProcess:
    """``kvloop serve`` as a subprocess."""

    url: str
    proc: subprocess.Popen

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)


@contextlib.contextmanager
def serve_subprocess(model_path: Path, *extra: str) -> Iterator[ServerProcess]:
    port = free_port()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_ARGS.items()]
    cmd = [sys.executable, "-m", "kvloop.cli", "serve", "--model", str(model_path), "--port",
           str(port), "--served-model-name", MODEL_NAME, "--log-interval", "0", *flags, *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvloop serve exited {proc.returncode}: "
                                   f"{proc.stdout.read() if proc.stdout else ''}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("kvloop serve did not come up")
            time.sleep(0.1)
        yield ServerProcess(url, proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
