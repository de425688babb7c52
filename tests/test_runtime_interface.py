"""No module reads another module's private names: ShardedModule's private attributes are read and written only
by the modules that define it (the classes of its MRO), others use ``sm.fxshard_state``
(``state.sharded_state.ShardedState``); and no fxshard module imports a ``_private`` name of another.

Static checks over the package's source (``ast``); the private names are collected from the class definitions, so
the lists cannot go stale."""

from __future__ import annotations

import ast
from pathlib import Path

import fxshard
from tests.package_ast import PKG, import_source, module_name


def _modules(root: Path = PKG) -> dict[str, ast.Module]:
    """Dotted module name -> its parsed source, for every module of the package under ``root``."""
    return {module_name(path, root): ast.parse(path.read_text(), str(path)) for path in sorted(root.rglob("*.py"))}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_private_names(tree: ast.AST, classes: set[str] | None = None) -> set[str]:
    """The private names the classes of ``tree`` (those named in ``classes``, or all) define: their methods and
    class attributes, and the attributes their methods assign on ``self``."""
    names = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef) or (classes is not None and node.name not in classes):
            continue
        for st in node.body:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(st.name)
            elif isinstance(st, (ast.Assign, ast.AnnAssign)):
                for target in st.targets if isinstance(st, ast.Assign) else [st.target]:
                    if isinstance(target, ast.Name):
                        names.add(target.id)
        for sub in ast.walk(node):
            if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                    and isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                names.add(sub.attr)
    return {n for n in names if _is_private(n)}


def _sharded_module_privates(modules: dict[str, ast.Module]) -> tuple[set[str], set[str]]:
    """(the private names ShardedModule's classes define, the modules defining those classes)."""
    defining: dict[str, set[str]] = {}
    for klass in fxshard.ShardedModule.__mro__:
        if klass.__module__.split(".")[0] == "fxshard":
            defining.setdefault(klass.__module__, set()).add(klass.__name__)
    names = set()
    for mod, classes in defining.items():
        names |= _own_private_names(modules[mod], classes)
    return names, set(defining)


def _dict_key(node: ast.AST) -> ast.AST | None:
    """The key ``node`` reads or writes in some object's ``__dict__`` (``x.__dict__[k]``, ``x.__dict__.get(k)``,
    ``.pop``, ``.setdefault``), where the object is not ``self``; None otherwise."""
    def other_dict(value: ast.AST) -> bool:
        return (isinstance(value, ast.Attribute) and value.attr == "__dict__"
                and not (isinstance(value.value, ast.Name) and value.value.id == "self"))
    if isinstance(node, ast.Subscript) and other_dict(node.value):
        return node.slice
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and other_dict(node.func.value)
            and node.func.attr in ("get", "pop", "setdefault") and node.args):
        return node.args[0]
    return None


def private_uses(modules: dict[str, ast.Module], names: set[str], defining: set[str]) -> list[str]:
    """Every place outside the modules ``defining`` ShardedModule that reads or writes one of its private
    attributes (``names``):
    ``x._name`` (unless a class of that module defines ``_name`` itself: ``ShardedFunction._info`` is
    ShardedFunction's), ``getattr``/``setattr``/``hasattr(x, "_name")``, and keys of another object's
    ``__dict__`` that are its names or not literal strings (records kept in the module's ``__dict__``)."""
    found = []
    for mod, tree in sorted(modules.items()):
        if mod in defining:
            continue
        watched = names - _own_private_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in watched:
                found.append(f"{mod}:{node.lineno}: .{node.attr}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1
                  and isinstance(node.args[1], ast.Constant) and node.args[1].value in watched):
                found.append(f"{mod}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
            elif (key := _dict_key(node)) is not None:
                literal = isinstance(key, ast.Constant) and isinstance(key.value, str)
                if not literal or key.value in names:
                    found.append(f"{mod}:{node.lineno}: __dict__[{ast.unparse(key)}]")
    return found


def private_imports(modules: dict[str, ast.Module], root: Path = PKG) -> set[tuple[str, str, str]]:
    """Every ``(importing module, source module, name)`` where an fxshard module imports a ``_private`` name
    from another fxshard module (``from .x import _name``; aliases do not matter, the imported name does)."""
    packages = {".".join(("fxshard",) + p.relative_to(root).parent.parts) for p in root.rglob("__init__.py")}
    found = set()
    for mod, tree in modules.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = import_source(mod, node, mod in packages)
            if source.split(".")[0] != "fxshard" or source == mod:
                continue
            for alias in node.names:
                if _is_private(alias.name) and f"{source}.{alias.name}" not in modules:  # a private module is fine
                    found.add((mod, source, alias.name))
    return found


def test_finders_find_what_they_look_for(tmp_path):
    """The checks below can fail: on a small package they report each kind of use they look for."""
    pkg = tmp_path / "fxshard"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("def _helper():\n    pass\n")
    (pkg / "a" / "y.py").write_text(
        "from .x import _helper\nfrom ..a.x import _helper as h\nfrom . import x as _x\n"
        "def f(sm):\n    sm.__dict__['_where'] = 1\n    sm.__dict__[KEY] = 2\n    m.__dict__['forward'] = 3\n"
        "    return sm._lookup('a'), getattr(sm, '_mesh'), sm._placements\n"
        "class Own:\n    def __init__(self):\n        self._info = 1\n    def g(self, other):\n"
        "        return other._info\n")
    modules = _modules(pkg)
    assert private_imports(modules, pkg) == {("fxshard.a.y", "fxshard.a.x", "_helper")}
    uses = private_uses(modules, {"_where", "_lookup", "_mesh", "_placements", "_info"}, set())
    for expected in ("._lookup", "getattr(..., '_mesh')", "._placements", "__dict__['_where']", "__dict__[KEY]"):
        assert any(u.endswith(expected) for u in uses), (expected, uses)
    assert not any("_info" in u or "forward" in u for u in uses), uses  # its own class's, and a public key


def test_no_module_reads_sharded_module_privates():
    """Modules other than ShardedModule's own use ``sm.fxshard_state`` and public functions, never its privates."""
    modules = _modules()
    names, defining = _sharded_module_privates(modules)
    assert {"_where", "_lookup", "_placements", "_dtensor"} <= names and defining
    assert private_uses(modules, names, defining) == []


def test_no_module_imports_private_names_of_another():
    found = private_imports(_modules())
    assert not found, sorted(found)


def test_the_interface_is_the_modules_state_and_copies_get_their_own_records(mesh2):
    """``sm.fxshard_state`` describes the module (its name, its tensors' layout) and is the one home of the
    records other modules keep per module; a copy (``copy.copy``, ``copy.deepcopy``) gets records of its own, so
    grad_guard's record (or the warning it gave) of one module is never the other's."""
    import copy

    import torch
    import torch.nn as nn

    from fxshard import ColwiseParallel

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    sm = fxshard.shard(model, mesh2, {"0": ColwiseParallel()}, example_inputs=(torch.randn(4, 8),))
    state = sm.fxshard_state
    assert state.where == "ShardedModule(Sequential)" and state.auto is None
    assert state.layout.how_split("0.weight") == "S(0) over 'tp'" and state.layout.how_split("2.weight") == ""
    assert state.layout.split_axes("0.weight") == [0] and state.grads.split == {0}
    assert tuple(state.layout.dtensor("0.weight", sm.get_parameter("0.weight").detach()).shape) == (16, 8)
    assert not any(k.startswith("_fxshard_grad") for k in vars(sm))  # grad_guard keeps nothing in sm.__dict__
    state.grads.warned = True
    for made in (copy.copy(sm), copy.deepcopy(sm)):
        assert made.fxshard_state.grads is not state.grads and made.fxshard_state.grads.warned
        made.fxshard_state.grads.warned = False
        assert state.grads.warned and made.fxshard_state.layout.placements == state.layout.placements
