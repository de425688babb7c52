"""The hooks fxshard registers on a user's modules, told apart from the user's own.

Tracing warns about forward hooks on the model (export runs them into the traced program), but the
runtime itself registers some (``runtime/sources.py`` refuses a forward on a model whose tensors a
ShardedModule has since trained). Those are marked here with :func:`own_hook`, so that tracing, which
sits below the runtime, can recognise them with :func:`is_own_hook` without importing it.
"""

from __future__ import annotations

from typing import Callable, TypeVar

__all__ = ["own_hook", "is_own_hook"]

F = TypeVar("F", bound=Callable)
_OWN: set[Callable] = set()


def own_hook(fn: F) -> F:
    """Mark ``fn`` (a module-level function fxshard registers as a hook) as fxshard's; returns ``fn``."""
    _OWN.add(fn)
    return fn


def is_own_hook(hook: object) -> bool:
    """Whether ``hook`` is a function marked with :func:`own_hook` (not one of the user's)."""
    return hook in _OWN
