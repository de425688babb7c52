"""Reading fxshard's own source as ``ast`` for the structural tests (``test_architecture.py``,
``test_runtime_interface.py``): module names and where an ``import`` statement imports from."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "fxshard"


def module_name(path: Path, pkg: Path = PKG) -> str:
    """The dotted name of the module at ``path`` in the package at ``pkg`` (a package's ``__init__`` is the
    package)."""
    parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_source(mod: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The absolute name of the module that ``node`` (a ``from ... import`` in module ``mod``, a package's
    ``__init__`` when ``is_package``) imports from."""
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_package else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))
