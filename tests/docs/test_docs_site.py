"""The documentation site builds with ``mkdocs build --strict`` (``mkdocs-material`` comes
with the dev extras): a broken link, a missing anchor or a page named in the nav but absent
from ``docs/`` fails the build."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_site_builds_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "index.html").is_file()
    assert (tmp_path / "tutorial" / "scheduler-loop" / "index.html").is_file()


def test_nav_names_existing_pages() -> None:
    """Every nav entry is a file under docs/ (the strict build checks it too; this names it)."""

    class _Loader(yaml.SafeLoader):
        pass

    # mkdocs.yml may carry !!python/name tags (pymdownx); they are irrelevant to the nav.
    _Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda *_: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)

    def pages(node: object) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [p for item in node for p in pages(item)]
        if isinstance(node, dict):
            return [p for value in node.values() for p in pages(value)]
        return []

    missing = [p for p in pages(config["nav"])
               if not p.startswith("http") and not (ROOT / "docs" / p).is_file()]
    assert not missing, f"nav pages not in docs/: {missing}"
