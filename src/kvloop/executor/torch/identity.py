"""What a result measured or derived on this machine for one model depends on, as a key:
the model's files, the CPU, the thread count and the software (versions, and the bytes of
the executor's own sources: a changed weight layout or kernel is a new key). Records
keyed by it (the token budget, the ready-to-run weights) are reused until one of these
changes."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
from functools import cache
from pathlib import Path
from typing import Any

import torch

from kvloop.executor.torch import native

MODEL_FILE_SUFFIXES = (".json", ".safetensors")
"""A model folder's files whose names, sizes and modification times make its identity."""


@cache
def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_files(path: Path) -> list[tuple[str, int, int]]:
    """(name, size, modification time in ns) of the model folder's config and weight files:
    a change to any of them (a new conversion, an edited config) is a different model.

    NOTE: sizes and times, not a hash of the bytes: hashing gigabytes of weights at every
    start would cost what the records save."""
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir()
                  if p.suffix in MODEL_FILE_SUFFIXES and p.is_file())


@cache
def executor_sources() -> str:
    """A hex digest of this executor's sources (its Python files and native kernels)."""
    root = Path(__file__).parent
    digest = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.suffix in (".py", ".cpp", ".h"):
            digest.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    return digest.hexdigest()


def machine_model_key(path: Path, **settings: Any) -> str:
    """A hex key of the model folder's files (:func:`model_files`), this CPU (name and
    feature flags), torch's thread count, the torch and kvloop versions, the executor's
    sources (:func:`executor_sources`), and ``settings``
    (dtype, quantization, ...: anything else the record depends on)."""
    parts = {
        "model": [str(path.resolve()), model_files(path)],
        "cpu": [cpu_name(), sorted(native.cpu_flags())],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "kvloop": [importlib.metadata.version("kvloop"), executor_sources()],
        "settings": {k: str(v) for k, v in sorted(settings.items())},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]
