"""Structural checks of the package (the map is ``docs/architecture.md``): the import graph inside
``fxshard/`` has no cycle, each subpackage imports only itself and the layers below it, the pipeline's
stages do not import each other, no file grows past ``MAX_LINES``, and no public name of a package
shadows one of its submodules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.package_ast import PKG, import_source, module_name


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """Module -> the fxshard modules it imports, at any depth of its code: function-level (lazy) imports and
    those under ``if TYPE_CHECKING:`` count too (a cycle through an annotation is still a cycle in the design).

    ``from . import x`` counts as importing ``x`` when ``x`` is a module; a package's own ``__init__``
    is not an edge of its submodules (Python runs it first, but it only re-exports).
    """
    modules = {module_name(p, pkg): p for p in pkg.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                stem = import_source(mod, node, path.name == "__init__.py")
                targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names]
            for t in targets:
                if t not in modules and (t == "fxshard" or t.startswith("fxshard.")):
                    raise ImportError(f"{path}:{node.lineno} imports {t}, which is not a module of the package")
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


def test_import_graph_counts_lazy_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "fxshard"
    (pkg / "core").mkdir(parents=True)
    for f in ("__init__.py", "core/__init__.py", "core/b.py", "core/c.py"):
        (pkg / f).write_text("")
    (pkg / "core" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import X\n"
                                      "def f():\n    from . import c\n")
    assert import_graph(pkg)["fxshard.core.a"] == {"fxshard.core.b", "fxshard.core.c"}
    (pkg / "core" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .gone import X\n")
    with pytest.raises(ImportError, match="fxshard.core.gone"):  # an annotation-only import of a moved module
        import_graph(pkg)


def test_no_import_cycle_inside_fxshard():
    graph = import_graph()
    assert "fxshard.planner.propagate" in graph and graph["fxshard.planner.propagate"]
    cycle = find_cycle(graph)
    assert not cycle, " -> ".join(cycle)


# The subpackages of fxshard, lowest first: each may import itself and the ones before it, never one after.
LAYERS = ["core", "plans", "comm", "ops", "rules", "tracing", "analysis", "planner", "passes", "state", "runtime",
          "report", "frontends", "devtools"]
MAX_LINES = 600


def layer_violations(graph: dict[str, set[str]], layers: list[str] = LAYERS) -> list[tuple[str, str]]:
    """``(importer, imported)`` for every import from a subpackage of ``layers`` into a later one or into a
    top-level module of the package (``fxshard/__init__``, ``models``: they sit above every layer)."""
    def rank(m: str) -> int:
        parts = m.split(".")
        return layers.index(parts[1]) if len(parts) >= 2 and parts[1] in layers else len(layers)

    return sorted((m, t) for m, ts in graph.items() if rank(m) < len(layers) for t in ts if rank(t) > rank(m))


def test_layer_finder_finds_an_upward_import():
    graph = {"fxshard.core.a": {"fxshard.plans.b"}, "fxshard.plans.b": {"fxshard.core.a"}, "fxshard.models": set(),
             "fxshard.core.c": {"fxshard.models"}}
    assert layer_violations(graph) == [("fxshard.core.a", "fxshard.plans.b"), ("fxshard.core.c", "fxshard.models")]


def test_every_module_lives_in_a_layer():
    top = {m for m in import_graph() if m.count(".") == 1 and m.split(".")[1] not in LAYERS}
    assert top == {"fxshard.__main__", "fxshard.models"}, top
    assert {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == set(LAYERS)


def test_subpackages_import_only_lower_layers():
    bad = layer_violations(import_graph())
    assert not bad, "; ".join(f"{m} imports {t}, a later layer (order: {', '.join(LAYERS)})" for m, t in bad)


def stage_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """``(importer, stage)`` for every module of ``fxshard.passes`` (other than ``pipeline``, which lists the
    stages) that imports another one: stages share what they need through lower layers."""
    stages = {m for m in graph if m.startswith("fxshard.passes.") and m != "fxshard.passes.pipeline"}
    return sorted((m, t) for m in stages for t in graph[m] if t in stages)


def test_stage_import_finder_finds_one():
    graph = {"fxshard.passes.a": {"fxshard.passes.b", "fxshard.core.ir"}, "fxshard.passes.b": {"fxshard.core.ir"},
             "fxshard.passes.pipeline": {"fxshard.passes.a"}}
    assert stage_imports(graph) == [("fxshard.passes.a", "fxshard.passes.b")]


def test_pipeline_stages_do_not_import_each_other():
    from fxshard.passes import pipeline

    stages = {p.fn.__module__ for p in vars(pipeline).values() if isinstance(p, pipeline.Pass)}
    assert {"fxshard.planner.propagate", "fxshard.passes.emit", "fxshard.passes.localize"} <= stages
    bad = stage_imports(import_graph())
    assert not bad, "; ".join(f"{m} imports the stage {t}: move what they share to a lower layer" for m, t in bad)


def test_no_file_is_too_long():
    long = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules by what they hold (at most {MAX_LINES} lines each): {long}"


def shadowing(pkg: Path = PKG) -> list[str]:
    """``package.name`` for every name a package's ``__init__`` binds (by import or definition) that is also
    the name of one of its submodules, other than by importing that submodule itself."""
    found = []
    for init in pkg.rglob("__init__.py"):
        subs = {p.stem for p in init.parent.glob("*.py")} | {p.name for p in init.parent.iterdir() if p.is_dir()}
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, ast.ImportFrom):
                bound = [(a.asname or a.name, a.name, node.level == 1 and not node.module) for a in node.names]
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                bound = [(node.name, node.name, False)]
            else:
                continue
            found += [f"{module_name(init, pkg)}.{b}" for b, orig, is_module in bound if b in subs and not (is_module and b == orig)]
    return sorted(found)


def test_no_public_name_shadows_a_submodule():
    assert not shadowing(), shadowing()
    import fxshard

    for name in ("memory", "jit", "constrain", "shard"):
        assert callable(getattr(fxshard, name)) and not (PKG / f"{name}.py").exists()


def test_examples_need_no_tests_directory():
    """Examples import fxshard (and torch), never the test suite: they run from an installed package."""
    examples = sorted((PKG.parent / "examples").glob("*.py"))
    assert examples
    for path in examples:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "tests" or n.startswith("tests.") for n in names), f"{path.name} imports {names}"
