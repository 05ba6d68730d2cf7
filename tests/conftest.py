"""Session set-up shared by every test folder."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def _native_kernels_built() -> None:
    """Build kvloop's CPU kernels (``executor.torch.native``, 25-90 s on a clean machine;
    their AVX2 build on a CPU with AVX2 but not AVX-512 VNNI) before any test, so
    that no test's timeout (a server's start, a Ray replica) pays for the compilation; a
    machine that cannot build them runs on torch's kernels."""
    if importlib.util.find_spec("torch") is None:
        return
    from kvloop.executor.torch import native

    native.kernels()


@pytest.fixture(scope="session", autouse=True)
def _machine_records_apart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The engines of the tests record their measured token budgets and their ready-to-run
    weights in folders of this session, not in the user's cache
    (``executor.torch.budget``, ``executor.torch.ready_weights``)."""
    if importlib.util.find_spec("torch") is None:
        yield
        return
    from kvloop.executor.torch import budget, ready_weights

    budgets = tmp_path_factory.mktemp("token_budgets")
    ready = tmp_path_factory.mktemp("ready_weights")
    patch = pytest.MonkeyPatch()
    patch.setattr(budget, "records_dir", lambda: budgets)
    patch.setattr(ready_weights, "ready_dir", lambda: ready)
    yield
    patch.undo()
