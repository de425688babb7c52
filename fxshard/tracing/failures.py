"""A failed trace as one readable ShardingError, and torch's output of a trace held back unless it succeeds.

Every tracer of fxshard (``trace_forward``, ``trace_joint``, ``fxshard.jit``) wraps its trace in
``tracing_errors`` (what was traced, the cause, the user's line, the fix) and ``quiet_unless_ok``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import traceback
from typing import Callable, Iterator, Optional, Union

from ..core.errors import ShardingError

__all__ = ["tracing_error", "tracing_errors", "quiet_unless_ok"]


def _user_frame(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    for fr in reversed(frames):
        if f"{os.sep}torch{os.sep}" not in fr.filename and f"{os.sep}fxshard{os.sep}" not in fr.filename:
            return f"{fr.filename}:{fr.lineno} ({fr.line})"
    return "unknown location"


_DATA_DEPENDENT = ("GuardOnDataDependentSymNode", "DataDependentOutputException", "DynamicOutputShapeException")


def tracing_error(what: str, e: BaseException, fix: str, where: Optional[str] = None) -> ShardingError:
    """One readable error for a failed trace: what was traced, the cause, the user's line (``where``, else
    the innermost user frame of ``e``), the fix. Raise it ``from None``: torch's own traceback and graph
    dumps say nothing the message does not (``__context__`` keeps them for debugging)."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if type(e).__name__ in _DATA_DEPENDENT:
        fix = ("a size or a Python branch there depends on tensor values, which one traced program for all "
               "inputs cannot express; use torch.where for value-dependent choices (torch.where(cond, a, b) "
               "instead of `if`, torch.where(mask, x, 0) instead of x[mask]), Python ints for sizes and split "
               "points, or run that part outside the sharded module")
    return ShardingError(f"could not trace {what}: {type(e).__name__}: {msg} [at {where or _user_frame(e)}]; {fix}")


Lazy = Union[str, Callable[[], Optional[str]]]


@contextlib.contextmanager
def tracing_errors(what: Lazy, fix: str, where: Optional[Lazy] = None) -> Iterator[None]:
    """Turn any exception the block raises (torch's tracing exceptions, a RuntimeError from an op)
    into :func:`tracing_error`; a ShardingError passes through unchanged. ``what`` and ``where``
    may be callables, read when the trace fails (e.g. the node being traced then)."""
    try:
        yield
    except ShardingError:
        raise
    except Exception as e:  # noqa: BLE001 - any tracing failure becomes one readable error
        what_s = what() if callable(what) else what
        where_s = where() if callable(where) else where
        raise tracing_error(what_s, e, fix, where_s) from None


@contextlib.contextmanager
def quiet_unless_ok() -> Iterator[None]:
    """Hold back what tracing prints to ``sys.stderr`` and logs through torch's loggers (torch prints a
    failing graph's code once per nested GraphModule): replayed when the block succeeds, dropped when it
    raises (the ShardingError says what matters)."""
    buf = io.StringIO()
    held: list[logging.LogRecord] = []
    loggers = [logging.getLogger(n) for n in list(logging.Logger.manager.loggerDict) if n.split(".")[0] == "torch"]
    handlers = list({id(h): h for lg in loggers for h in lg.handlers}.values())

    def hold(record: logging.LogRecord) -> bool:
        held.append(record)
        return False

    for h in handlers:
        h.addFilter(hold)
    try:
        with contextlib.redirect_stderr(buf):
            yield
    finally:
        for h in handlers:
            h.removeFilter(hold)
    sys.stderr.write(buf.getvalue())
    for record in held:
        logging.getLogger(record.name).handle(record)
