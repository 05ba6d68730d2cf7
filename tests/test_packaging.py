"""What a wheel of kvloop carries: every data file the package reads at run time is listed
in ``pyproject.toml``'s package data (a non-editable install ships nothing else), the CPU
kernels' C++ sources above all: without them ``native.kernels()`` cannot build and every
``pip install kvloop`` would silently run torch's slower kernels."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "kvloop"


def _shipped() -> set[Path]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["kvloop"]
    return {p for pattern in patterns for p in PACKAGE.glob(pattern) if p.is_file()}


def test_the_kernels_sources_ship_in_the_wheel() -> None:
    native = PACKAGE / "executor" / "torch" / "native"
    sources = {p for p in native.iterdir() if p.suffix in (".cpp", ".h")}
    assert len(sources) >= 10
    assert not sources - _shipped(), sorted(p.name for p in sources - _shipped())


def test_every_data_folder_ships() -> None:
    """Non-Python files under the package (data, attributions) are in the package data."""
    ignored = {".py", ".pyc"}
    files = {p for p in PACKAGE.rglob("*") if p.is_file() and p.suffix not in ignored
             and "__pycache__" not in p.parts}
    assert not files - _shipped(), sorted(str(p.relative_to(PACKAGE)) for p in files - _shipped())
