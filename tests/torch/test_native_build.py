"""How kvloop's CPU kernels are built, loaded and run next to other threads
(``executor.torch.native``): a cache that cannot be written or a stale lock left by a killed
build never stops kvloop, ``KVLOOP_NATIVE=0`` turns them off, and a kernel call lets other
Python threads run."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvloop.executor.torch import native  # noqa: E402
from kvloop.executor.torch.linear import Int4Linear  # noqa: E402

KERNELS = native.kernels()
pytestmark = pytest.mark.skipif(
    KERNELS is None, reason=f"kvloop's CPU kernels do not run here: "
    f"{native.unavailable_reason() or 'their build failed'}")

LOAD = ("import logging, sys\nlogging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "from kvloop.executor.torch import native\nprint('LOADED', native.kernels() is not None)\n")


def _python(env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", LOAD], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_an_unwritable_cache_falls_back_to_torch_kernels(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    proc = _python({"KVLOOP_CACHE_DIR": str(blocked / "cache")})
    assert proc.returncode == 0, proc.stderr[-800:]
    assert "LOADED False" in proc.stdout
    assert "kvloop's CPU kernels are off" in proc.stdout + proc.stderr


def test_kvloop_native_0_turns_them_off() -> None:
    proc = _python({"KVLOOP_NATIVE": "off"})
    assert "LOADED False" in proc.stdout and "KVLOOP_NATIVE=off" in proc.stdout, proc.stdout


def test_a_stale_build_lock_does_not_hang_the_next_process() -> None:
    """torch's build lock, left behind by a build killed mid-way, is removed under kvloop's
    own flock (which the OS released with the killed process)."""
    build = Path(KERNELS.__file__).parent
    lock = build / "lock"
    lock.write_text("")
    try:
        proc = _python({}, timeout=90)
    finally:
        lock.unlink(missing_ok=True)
    assert "LOADED True" in proc.stdout, proc.stdout + proc.stderr[-800:]


def test_a_kernel_call_releases_the_gil() -> None:
    """Another Python thread (the server's event loop) keeps running during a long call."""
    gen = torch.Generator().manual_seed(0)
    lin = Int4Linear(torch.randn(4096, 2048, generator=gen), None, torch.bfloat16)
    assert lin.native
    x = torch.randn(1024, 2048, generator=gen).to(torch.bfloat16)
    ticks: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # NOTE: leaves the ticker a core on a 2-core machine
    thread = threading.Thread(target=ticker)
    thread.start()
    try:
        time.sleep(0.01)
        start = time.perf_counter()
        lin(x)
        end = time.perf_counter()
    finally:
        stop.set()
        thread.join()
        torch.set_num_threads(threads)
    during = [t for t in ticks if start < t < end]
    assert end - start > 0.02, "the call is too short to tell"
    assert len(during) >= 5, (len(during), end - start)


def test_no_compiler_is_one_clear_line(tmp_path: Path) -> None:
    """Without a C++ compiler the kernels are off after one line, with nothing compiled."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    proc = _python({"KVLOOP_CACHE_DIR": str(tmp_path / "cache"), "PATH": str(bin_dir),
                    "CXX": "kvloop-no-such-compiler"})
    assert "LOADED False" in proc.stdout, proc.stdout + proc.stderr[-800:]
    assert "no C++ compiler (kvloop-no-such-compiler)" in proc.stdout
    assert "compiling" not in proc.stderr


def test_a_finished_build_loads_from_a_cache_it_cannot_write(tmp_path: Path) -> None:
    """A read-only cache holding a finished build (simulated: the lock file cannot be
    created) still loads it, rather than falling back."""
    built = Path(KERNELS.__file__)
    copy = tmp_path / "cache" / "native" / built.parent.name
    copy.mkdir(parents=True)
    (copy / built.name).write_bytes(built.read_bytes())
    (copy / "kvloop.lock").mkdir()  # NOTE: open(..., "w") on it fails like a read-only dir
    proc = _python({"KVLOOP_CACHE_DIR": str(tmp_path / "cache")})
    assert "LOADED True" in proc.stdout, proc.stdout + proc.stderr[-800:]



def test_a_loader_failure_over_a_finished_build_is_not_a_failed_build(tmp_path: Path) -> None:
    """torch's loader failing over a finished build (here: its lock file removed under it, as
    a concurrent process can) imports the build and leaves no ``build-failed.txt``, which
    would turn the kernels off for every later process."""
    built = Path(KERNELS.__file__)
    copy = tmp_path / "cache" / "native" / built.parent.name
    copy.mkdir(parents=True)
    (copy / built.name).write_bytes(built.read_bytes())
    code = ("import torch.utils.cpp_extension as ext\n"
            "def load(**kw): raise FileNotFoundError(2, 'No such file', kw['build_directory'] "
            "+ '/lock')\n"
            "ext.load = load\n" + LOAD)
    proc = subprocess.run([sys.executable, "-c", code],
                          env={**os.environ, "KVLOOP_CACHE_DIR": str(tmp_path / "cache")},
                          capture_output=True, text=True, timeout=120, check=False)
    assert "LOADED True" in proc.stdout, proc.stdout + proc.stderr[-800:]
    assert not (copy / "build-failed.txt").exists()


def test_two_environments_with_the_same_torch_build_apart(monkeypatch, tmp_path: Path) -> None:
    # torch's build files name its installation's include paths: a second virtual
    # environment with the same torch version must not share (and recompile) the build.
    spec = native.build_for_cpu() or native.FULL
    here = native.build_tag(spec)
    other = tmp_path / "venv" / "site-packages" / "torch" / "__init__.py"
    other.parent.mkdir(parents=True)
    other.write_text("")
    monkeypatch.setattr(native.torch, "__file__", str(other))
    elsewhere = native.build_tag(spec)
    assert elsewhere != here
    assert elsewhere.split("-")[:-1] == here.split("-")[:-1]  # same versions and variant
