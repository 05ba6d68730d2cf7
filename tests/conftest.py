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
def _token_budget_records_apart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The engines of the tests record their measured token budgets in a folder of this
    session, not in the user's cache (``executor.torch.budget``)."""
    if importlib.util.find_spec("torch") is None:
        yield
        return
    from kvloop.executor.torch import budget

    folder = tmp_path_factory.mktemp("token_budgets")
    patch = pytest.MonkeyPatch()
    patch.setattr(budget, "records_dir", lambda: folder)
    yield
    patch.undo()
