"""The core, the simulated executor and the simulator driver import no torch, numpy or server."""

import os
import subprocess
import sys

_HEAVY = ("torch", "numpy", "fastapi")
_CHECK = (
    "import kvloop.core, kvloop.executor.simulated, kvloop.sim.driver, sys; "
    "assert not any(m.split('.')[0] in {'torch','numpy','fastapi'} for m in sys.modules)"
)


def _run(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _CHECK],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_core_imports_no_heavy_packages():
    proc = _run(dict(os.environ))
    assert proc.returncode == 0, proc.stderr


def test_core_imports_no_heavy_packages_even_when_importable(tmp_path):
    # Where torch/numpy/fastapi are not installed the check above passes trivially (and a
    # guarded ``try: import numpy`` would hide); empty stand-ins make any import visible.
    for name in _HEAVY:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    proc = _run({**os.environ, "PYTHONPATH": path})
    assert proc.returncode == 0, proc.stderr
