"""Structural checks of the engine core (issue 12): the import graph inside ``fxshard/`` has no cycle,
and no module of ``fxshard/passes/`` imports a pipeline pass (they share ``ir``, the registry and
the leaf modules instead)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "fxshard"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` (imports for annotations only)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """Module -> the fxshard modules it imports, at any depth of its code (function-level imports too;
    not those under ``if TYPE_CHECKING:``, which never run).

    ``from . import x`` counts as importing ``x`` when ``x`` is a module; a package's own ``__init__``
    is not an edge of its submodules (Python runs it first, but it only re-exports).
    """
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names]
            for t in targets:
                if t in modules and t != mod and path.name != "__init__.py":
                    graph[mod].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a list of modules (first == last), or [] when the graph is acyclic."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return []


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_inside_fxshard():
    graph = import_graph()
    assert "fxshard.planner.propagate" in graph and graph["fxshard.planner.propagate"]
    cycle = find_cycle(graph)
    assert not cycle, " -> ".join(cycle)


def pass_modules() -> set[str]:
    """The modules that hold the function of a pipeline stage (every ``Pass`` in ``fxshard.passes.pipeline``)."""
    from fxshard.passes import pipeline

    return {p.fn.__module__ for p in vars(pipeline).values() if isinstance(p, pipeline.Pass)}


def pass_imports(graph: dict[str, set[str]], passes: set[str]) -> list[tuple[str, str]]:
    """``(importer, pass)`` for every module of ``fxshard.passes`` that imports a pass module."""
    return sorted((m, t) for m, ts in graph.items() if m.startswith("fxshard.passes.") for t in ts
                  if t in passes and t != m)


def test_pass_import_finder_finds_one():
    graph = {"fxshard.passes.a": {"fxshard.passes.b", "fxshard.core.ir"}, "fxshard.passes.b": {"fxshard.core.ir"},
             "fxshard.passes.pipeline": {"fxshard.passes.a"}}
    assert pass_imports(graph, {"fxshard.passes.a", "fxshard.passes.b"}) == [("fxshard.passes.a", "fxshard.passes.b")]
    assert pass_imports(graph, {"fxshard.passes.a"}) == []


def test_passes_do_not_import_each_other():
    passes = pass_modules()
    assert {"fxshard.planner.propagate", "fxshard.planner.solve", "fxshard.passes.emit"} <= passes
    bad = pass_imports(import_graph(), passes)
    assert not bad, "; ".join(f"{m} imports the pass {t}: move what they share into fxshard/core/ir.py or the registry"
                              for m, t in bad)


def test_examples_need_no_tests_directory():
    """Examples import fxshard (and torch), never the test suite: they run from an installed package."""
    examples = sorted((PKG.parent / "examples").glob("*.py"))
    assert examples
    for path in examples:
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "tests" or n.startswith("tests.") for n in names), f"{path.name} imports {names}"
