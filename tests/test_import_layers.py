"""Imports go one way: no module-level import cycle in kvloop, and nothing below the command
line (``kvloop.cli``) imports it."""

from __future__ import annotations

import ast
from pathlib import Path

import kvloop

ROOT = Path(kvloop.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _imports(mods: dict[str, Path], top_level_only: bool) -> dict[str, set[str]]:
    """Module -> kvloop modules it imports (``from a import b`` counts ``a.b`` if a module)."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        nodes = tree.body if top_level_only else list(ast.walk(tree))
        deps = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            deps |= {r for n in names if (r := resolve(n)) and r != mod}
        graph[mod] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return [*path[path.index(d):], d]
            if d not in state and (found := visit(d)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_module_level_import_cycle():
    cycle = _cycle(_imports(_modules(), top_level_only=True))
    assert cycle is None, " -> ".join(cycle)


def test_nothing_below_the_command_line_imports_it():
    graph = _imports(_modules(), top_level_only=False)
    below = {m for m in graph if m != "kvloop.cli" and not m.startswith("kvloop.cli.")}
    bad = sorted(m for m in below if any(d.partition(".cli")[1] and d.startswith("kvloop.cli")
                                         for d in graph[m]))
    assert not bad, f"import kvloop.cli from below it: {bad}"


LAYERS = ["kvloop.errors", "kvloop.paths", "kvloop.config", "kvloop.sampling_params",
          "kvloop.request_fields", "kvloop.core", "kvloop.executor", "kvloop.engine",
          "kvloop.server", "kvloop.cluster", "kvloop.sim", "kvloop.bench", "kvloop.viz",
          "kvloop.cli"]
"""ARCHITECTURE.md's layers, lowest first (the routers of ``kvloop.cluster`` serve both the
Ray deployment and the cluster simulator, so they sit below ``kvloop.sim``)."""


def _layer(module: str) -> int | None:
    found = None
    for i, prefix in enumerate(LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            found = i
    return found


def test_no_module_imports_a_layer_above_it():
    graph = _imports(_modules(), top_level_only=False)
    bad = sorted((m, d) for m, deps in graph.items() for d in deps
                 if (lm := _layer(m)) is not None and (ld := _layer(d)) is not None and ld > lm)
    assert not bad, f"imports that go up a layer: {bad}"
