"""Python values traced code reads from outside its arguments, and the check that they stay put.

``fxshard.jit`` runs the function's Python code once per traced signature; a Python number it reads
from a global or a closure (``p - LR * g`` with a module-level ``LR``) is baked into the program as
the value it had then. Rebinding it later (a learning-rate schedule that assigns ``LR``) changes
what eager computes from the next call on, and nothing under fxshard: measured, the program kept
``LR = 0.5`` after it became 0.1 (jax.jit bakes such values the same way, silently).

:func:`captured_scalars` lists the scalars a function reads by name: the globals (``LOAD_GLOBAL``)
and closure variables (``LOAD_DEREF``) of its code and of the code nested in it (lambdas, inner
functions), following the Python functions it reads that way when they are defined in the same
module; decorators (``functools.wraps``) are looked through to the function they wrap. For a bound method
(``fxshard.jit(trainer.step, ...)``), also the attributes it reads from its instance, in nested comprehensions
and lambdas too (``self.lr``, ``self.cfg.lr``: instance dicts only, no property is run). Scalars are numbers,
strings, ``None`` and tuples of those; other objects (modules, functions, config objects) are not compared, nor
are the attributes read from them.
:func:`check_captured` compares them at each call and raises a ShardingError naming the first one that
changed. ``fxshard.shard`` does the same for the ``forward`` of the model's own module classes
(:func:`forward_scalars`; torch's are left out): a module-level ``TEMPERATURE`` a forward divides by.
"""

from __future__ import annotations

import dis
import inspect
import types
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

from ..core.errors import ShardingError

__all__ = ["Captured", "captured_scalars", "check_captured", "forward_scalars", "settled_after_trace"]

_SCALARS = (bool, int, float, complex, str, type(None))
_MISSING = object()


def _scalar(value: Any) -> bool:
    return isinstance(value, _SCALARS) or (isinstance(value, tuple) and all(isinstance(v, _SCALARS) for v in value))


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and a == b)  # `is`: a NaN is itself


@dataclass(frozen=True)
class Captured:
    """One scalar a function reads by name: a global of ``where`` or a closure cell, and its value at trace."""

    name: str
    kind: str  # "global", "closure variable" or "attribute" (``name``: ``self.cfg.lr``; ``where``: the instance)
    reader: str  # the qualified name of the function that reads it
    where: Any = field(repr=False, compare=False)  # the function's globals dict, or the closure cell
    value: Any

    def __deepcopy__(self, memo: dict) -> "Captured":
        return self  # it refers to the live variable: a copied module checks the same one

    def __reduce__(self) -> tuple:
        """Pickled by reference: a global by its module's name; a closure variable or an attribute as its value
        at trace time."""
        if self.kind == "global":
            return _global, (self.where.get("__name__"), self.name, self.reader, self.value)
        return Captured, (self.name, self.kind, self.reader, _Kept(self.value), self.value)

    def now(self) -> Any:
        if isinstance(self.where, _Kept):
            return self.where.cell_contents
        if self.kind == "global":
            return self.where.get(self.name, _MISSING)
        if self.kind == "attribute":
            return _attribute(self.where, self.name.split(".")[1:])
        try:
            return self.where.cell_contents
        except ValueError:  # an empty cell
            return _MISSING


def _attribute(obj: Any, path: Sequence[str]) -> Any:
    """``obj.a.b`` for ``path`` ``["a", "b"]``, read from instance dicts only (no property runs), or _MISSING."""
    for name in path:
        obj = getattr(obj, "__dict__", {}).get(name, _MISSING)
        if obj is _MISSING:
            return _MISSING
    return obj


def _self_attributes(method: Any) -> list[Captured]:
    """The scalar attributes a bound method reads from its instance by name (``self.lr``, ``self.cfg.lr``)."""
    f = _unwrapped(method)
    code, obj = getattr(f, "__code__", None), getattr(method, "__self__", None)
    if not isinstance(code, types.CodeType) or obj is None or isinstance(obj, type) or not code.co_argcount:
        return []
    me = code.co_varnames[0]
    found: dict[str, Captured] = {}
    for c in _codes(code):
        # the instance as a local, or as a cell where nested code uses it (a comprehension before Python 3.12,
        # a lambda): read through LOAD_DEREF, here and in that nested code
        loads = {"LOAD_FAST", "LOAD_FAST_CHECK"} if c is code else set()
        if me in (c.co_cellvars if c is code else c.co_freevars):  # nested code's own ``self`` is another one
            loads.add("LOAD_DEREF")
        path: Optional[list[str]] = None
        for ins in dis.get_instructions(c):
            if path is not None and ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and isinstance(ins.argval, str):
                path.append(ins.argval)
                continue
            if path:
                value = _attribute(obj, path)
                name = ".".join([me, *path])
                if _scalar(value) and value is not _MISSING:
                    found.setdefault(name, Captured(name, "attribute", f.__qualname__, obj, value))
            path = [] if ins.opname in loads and ins.argval == me else None
    return list(found.values())


class _Kept:
    """A closure variable after unpickling: its value at trace time, which no code can change."""

    def __init__(self, value: Any) -> None:
        self.cell_contents = value


def _global(module: str, name: str, reader: str, value: Any) -> Captured:
    import importlib

    return Captured(name, "global", reader, vars(importlib.import_module(module)), value)


def _unwrapped(f: Any) -> Any:
    """``f`` without the ``functools.wraps`` layers of decorators (``__wrapped__``)."""
    try:
        return inspect.unwrap(getattr(f, "__func__", f))
    except ValueError:  # a cycle of __wrapped__
        return f


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
    module = getattr(_unwrapped(fn), "__module__", None)

    def visit(f: Any) -> None:
        f = _unwrapped(f)  # bound methods, and decorators (functools.wraps): read what they wrap
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
                elif isinstance(value, types.FunctionType) and _unwrapped(value).__module__ == module:
                    visit(value)

    visit(fn)
    return list(found.values()) + _self_attributes(fn)


def forward_scalars(model: Any) -> list[Captured]:
    """:func:`captured_scalars` of the ``forward`` each module class in ``model`` (an ``nn.Module``) and its base
    classes define, torch's and fxshard's left out, without repeats."""
    found: dict[tuple[int, str], Captured] = {}
    classes = {base for m in model.modules() for base in type(m).__mro__}  # a forward may call super().forward
    for cls in sorted(classes, key=lambda c: f"{c.__module__}.{c.__qualname__}"):
        if cls.__module__.split(".")[0] in ("torch", "fxshard", "builtins") or "forward" not in vars(cls):
            continue
        for c in captured_scalars(vars(cls)["forward"]):
            found.setdefault((id(c.where), c.name), c)
    return list(found.values())


_JIT_FIX = ("Pass the value as an argument: a tensor changes without tracing again, a Python scalar argument "
            "traces once per distinct value")


def settled_after_trace(captured: Sequence[Captured], what: str) -> list[Captured]:
    """Requires: ``captured`` from :func:`captured_scalars` just before a trace, called right after it.
    Ensures: the records the check compares from now on. A variable the traced code filled from ``None`` (a
    lazily computed module-level flag) is recorded with its new value; any other change the traced code made
    (a counter) is a ShardingError: the program would keep one value where eager's changes every call."""
    out = []
    for c in captured:
        now = c.now()
        if not _same(now, c.value):
            if c.value is not None or not _scalar(now):
                raise ShardingError(
                    f"{what} changed the {c.kind} {c.name!r} (in {c.reader}) from {c.value!r} to {_shown(now)}; "
                    f"fxshard runs that Python code once, while tracing, so the program would never change it "
                    f"again. Keep the code pure: return the new value instead")
            c = replace(c, value=now)
        out.append(c)
    return out


def _shown(value: Any) -> str:
    return "deleted" if value is _MISSING else repr(value)


def check_captured(captured: Sequence[Captured], what: str, fix: str = _JIT_FIX) -> None:
    """Requires: ``captured`` as :func:`settled_after_trace` left them. Ensures: each still holds the value it
    had when traced, else a ShardingError naming it, both values and ``fix``."""
    for c in captured:
        now = c.now()
        if not _same(now, c.value):
            raise ShardingError(
                f"{what} reads the {c.kind} {c.name!r} (in {c.reader}), which was {c.value!r} when it was traced and "
                f"is {_shown(now)} now; the program computes with {c.value!r} (tracing bakes in the Python values it "
                f"reads), so it would no longer match eager. {fix}")
