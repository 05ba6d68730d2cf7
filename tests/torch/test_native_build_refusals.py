"""How kvloop's CPU kernels are refused before they run, on any machine (the kernels need
not build here): an unknown ``KVLOOP_NATIVE`` value is named, and a failed build is not
retried until the compiler changes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the kernels build on Linux")

BUILD = ("import sys\nfrom kvloop.executor.torch import native\ntry:\n"
         "    native._build_and_load(native.FULL)\n"
         "except Exception as exc:\n    print('FAILED', exc)\nelse:\n    print('BUILT')\n")
LOAD = ("import logging, sys\nlogging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "from kvloop.executor.torch import native\nprint('LOADED', native.kernels() is not None)\n")


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120, check=False)


def test_an_unknown_kvloop_native_value_is_named_not_guessed() -> None:
    """``KVLOOP_NATIVE=banana`` is neither on nor off: the kernels stay off, with a warning
    that names the accepted values."""
    proc = _python(LOAD, {"KVLOOP_NATIVE": "banana"})
    assert "LOADED False" in proc.stdout, proc.stdout + proc.stderr[-800:]
    assert "WARNING" in proc.stdout and "'banana' is not one of" in proc.stdout, proc.stdout
    assert "0/false/no/off" in proc.stdout


def _failing_compiler(path: Path) -> Path:
    path.write_text("#!/bin/sh\necho 'kvloop test: this compiler always fails' >&2\nexit 1\n")
    path.chmod(0o755)
    return path


def test_a_failed_build_is_not_retried_until_the_compiler_changes(tmp_path: Path) -> None:
    """A failed build leaves ``build-failed.txt`` naming its compiler: the next process with
    that compiler does not compile again, one with another compiler does."""
    cache = tmp_path / "cache"
    first = _failing_compiler(tmp_path / "cxx-one")
    env = {"KVLOOP_CACHE_DIR": str(cache), "CXX": str(first)}
    proc = _python(BUILD, env)
    assert "FAILED their build failed (" in proc.stdout, proc.stdout + proc.stderr[-800:]
    assert "compiling" in proc.stderr
    assert ".;" not in proc.stdout
    markers = list(cache.glob("native/*/build-failed.txt"))
    assert len(markers) == 1 and str(first) in markers[0].read_text().splitlines()[0]

    again = _python(BUILD, env)
    assert "compiling" not in again.stderr
    assert "failed before with the same compiler" in again.stdout, again.stdout

    second = _failing_compiler(tmp_path / "cxx-two")
    retried = _python(BUILD, {**env, "CXX": str(second)})
    assert "FAILED their build failed (" in retried.stdout
    assert "compiling" in retried.stderr, retried.stderr[-800:]
    assert str(second) in markers[0].read_text().splitlines()[0]


def test_the_build_follows_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The full build where the CPU has AVX-512 VNNI, the AVX2 one where it has AVX2 alone,
    none (with a reason naming what is missing) elsewhere."""
    from kvloop.executor.torch import native

    full = native.FULL.required | {"avx2", "fma", "f16c"}
    for flags, build in [(full, native.FULL), (native.AVX2.required, native.AVX2),
                         (frozenset({"sse4_2", "avx"}), None)]:
        monkeypatch.setattr(native, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert native.build_for_cpu() is build
    assert native.unavailable_reason() == (
        "the CPU lacks avx512_vnni, avx512bw, avx512dq, avx512f, avx512vl or avx2, f16c, fma")
