"""Python values a jitted function reads from outside its arguments, and the check that they stay put.

``fxshard.jit`` runs the function's Python code once per traced signature; a Python number it reads
from a global or a closure (``p - LR * g`` with a module-level ``LR``) is baked into the program as
the value it had then. Rebinding it later (a learning-rate schedule that assigns ``LR``) changes
what eager computes from the next call on, and nothing under fxshard: measured, the program kept
``LR = 0.5`` after it became 0.1 (jax.jit bakes such values the same way, silently).

:func:`captured_scalars` lists the scalars a function reads by name: the globals (``LOAD_GLOBAL``)
and closure variables (``LOAD_DEREF``) of its code and of the code nested in it (lambdas, inner
functions), following the Python functions it reads that way when they are defined in the same
module. Scalars are numbers, strings, ``None`` and tuples of those; other objects (modules,
functions, config objects) are not compared, nor are the attributes read from them.
:func:`check_captured` compares them at each call and raises a ShardingError naming the first one that
changed.
"""

from __future__ import annotations

import dis
import types
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .errors import ShardingError

__all__ = ["Captured", "captured_scalars", "check_captured"]

_SCALARS = (bool, int, float, complex, str, type(None))
_MISSING = object()


def _scalar(value: Any) -> bool:
    return isinstance(value, _SCALARS) or (isinstance(value, tuple) and all(isinstance(v, _SCALARS) for v in value))


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


@dataclass(frozen=True)
class Captured:
    """One scalar a function reads by name: a global of ``where`` or a closure cell, and its value at trace."""

    name: str
    kind: str  # "global" or "closure variable"
    reader: str  # the qualified name of the function that reads it
    where: Any  # the function's globals dict, or the closure cell
    value: Any

    def now(self) -> Any:
        if self.kind == "global":
            return self.where.get(self.name, _MISSING)
        try:
            return self.where.cell_contents
        except ValueError:  # an empty cell
            return _MISSING


def _codes(code: types.CodeType):
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _codes(c)


def captured_scalars(fn: Callable) -> list[Captured]:
    """Requires: ``fn`` is a Python callable (others give ``[]``). Ensures: one :class:`Captured` per scalar
    global or closure variable ``fn`` reads by name, with its value now (module doc)."""
    found: dict[tuple[int, str], Captured] = {}
    seen: set[int] = set()
    module = getattr(fn, "__module__", None)

    def visit(f: Any) -> None:
        f = getattr(f, "__func__", f)  # bound methods
        code = getattr(f, "__code__", None)
        if not isinstance(code, types.CodeType) or id(f) in seen:
            return
        seen.add(id(f))
        cells = dict(zip(code.co_freevars, f.__closure__ or ()))
        globs = getattr(f, "__globals__", {})
        for c in _codes(code):
            for ins in dis.get_instructions(c):
                if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and isinstance(ins.argval, str):
                    name, where, kind = ins.argval, globs, "global"
                    value = globs.get(name, _MISSING)
                elif ins.opname in ("LOAD_DEREF", "LOAD_CLOSURE") and ins.argval in cells:
                    name, where, kind = ins.argval, cells[ins.argval], "closure variable"
                    try:
                        value = where.cell_contents
                    except ValueError:
                        continue
                else:
                    continue
                if _scalar(value):
                    found.setdefault((id(where), name), Captured(name, kind, f.__qualname__, where, value))
                elif isinstance(value, types.FunctionType) and value.__module__ == module:
                    visit(value)

    visit(fn)
    return list(found.values())


def check_captured(captured: Sequence[Captured], what: str, changed_by_fn: bool = False) -> None:
    """Requires: ``captured`` from :func:`captured_scalars` before the trace. Ensures: each still holds the
    value it had then, else a ShardingError naming it, both values and the fix (``changed_by_fn``: the check
    right after the trace, so the function itself changed it)."""
    for c in captured:
        now = c.now()
        if _same(now, c.value):
            continue
        shown = "deleted" if now is _MISSING else repr(now)
        if changed_by_fn:
            raise ShardingError(
                f"{what} changed the {c.kind} {c.name!r} (in {c.reader}) from {c.value!r} to {shown}; fxshard.jit runs the "
                f"function's Python code once per traced signature, so the program would never change it again. "
                f"A jitted function must be pure: return the new value instead")
        raise ShardingError(
            f"{what} reads the {c.kind} {c.name!r} (in {c.reader}), which was {c.value!r} when it was traced and is {shown} now; "
            f"the program computes with {c.value!r} (tracing bakes in Python values it reads, as jax.jit does), so "
            f"it would no longer match the function. Pass the value as an argument: a tensor "
            f"(torch.tensor({c.name.lower()})) changes without tracing again, a Python scalar argument traces "
            f"once per distinct value")
