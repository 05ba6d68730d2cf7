"""The ``kvloop`` command line, above every other layer: ``main`` (the console entry point)
and one module per subcommand (``generate``, ``serve`` and ``serve_ray``, ``simulate``,
``sweep``, ``profile``, ``bench``, ``trace``) with the shared flags in ``args``. Nothing
below ``cli`` imports it."""

from __future__ import annotations

from kvloop.cli.main import main

__all__ = ["main"]
