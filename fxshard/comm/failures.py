"""A collective that fails inside a sharded program becomes a ShardingError naming it.

When a rank skips or reorders a call, its peers wait in a collective the rank never
joins. With a timeout on the process group (``init_mesh(timeout=...)``) gloo raises a
bare ``RuntimeError: Timed out waiting ...`` (a departed peer: ``Connection closed by
peer``); ``run_program`` turns that into an error naming the program, the collective,
why it was inserted, and the likely cause.
"""

from __future__ import annotations

import re
import traceback
from typing import Any, Callable, TypeVar

import torch.distributed as dist
import torch.fx as fx

from ..core.ir import COMM_KEY
from ..core.errors import ShardingError

__all__ = ["run_program", "is_comm_failure", "comm_failure", "guard_collective"]

T = TypeVar("T")

_COMM_WORDS = re.compile(r"timed out|timeout|connection (closed|reset)|broken pipe|gloo|nccl|socket", re.I)

CAUSE = ("another rank did not reach this collective within the process group's timeout: a rank skipped or "
         "reordered a call (every rank must make the same calls in the same order; no rank-dependent "
         "`if rank == 0: ...` around sharded calls), or a peer process failed (see its log)")
FIX = ("make every rank run the same calls in the same order; the timeout is init_mesh(timeout=...) "
       "(or torch.distributed.init_process_group(timeout=...))")


def is_comm_failure(e: BaseException) -> bool:
    """Whether ``e`` is a process-group failure (a timeout or a departed peer), not a compute error."""
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    return isinstance(e, RuntimeError) and bool(_COMM_WORDS.search(str(e)))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return re.sub(r"^\[[^\]]*\] ", "", text[0]) if text else type(e).__name__


def _failing_node(gm: fx.GraphModule, e: BaseException) -> Any:
    """The graph node whose generated line raised ``e`` (None when the traceback does not say)."""
    code = type(gm).forward.__code__
    lineno_map = getattr(gm, "_lineno_map", None) or {}
    nodes = list(gm.graph.nodes)
    found = None
    for frame, lineno in traceback.walk_tb(e.__traceback__):
        if frame.f_code is code:
            idx = lineno_map.get(lineno - code.co_firstlineno)
            if idx is not None and idx < len(nodes):
                found = nodes[idx]
    return found


def comm_failure(gm: fx.GraphModule, e: BaseException, where: str) -> ShardingError:
    """The ShardingError for collective failure ``e`` raised while running ``gm`` (``where``: which program)."""
    node = _failing_node(gm, e)
    if node is not None and COMM_KEY not in node.meta:  # a wait: the collective it waits for
        node = next((a for a in node.all_input_nodes if COMM_KEY in a.meta), None)
    if node is not None:
        c = node.meta[COMM_KEY]
        at = f" at {c['source']}" if c.get("source") else ""
        what = (f"the {c['kind']} over mesh axis {c['axis']!r} ({c['src']} -> {c['dst']} of {c['value']} for "
                f"{c['op']}{at})")
    else:
        what = "a collective"
    return ShardingError(f"{where}: {what} failed: {type(e).__name__}: {_first_line(e)}. Likely cause: {CAUSE}; "
                         f"fix: {FIX}")


def run_program(gm: fx.GraphModule, args: Any, where: str) -> Any:
    """``gm(*args)``, with a failed collective raised as a ShardingError naming it (see module doc)."""
    try:
        return gm.forward(*args)  # not gm(*args): fx's call wrapper drops the traceback that names the node
    except RuntimeError as e:
        if is_comm_failure(e):
            raise comm_failure(gm, e, where) from e
        raise


def guard_collective(fn: Callable[[], T], where: str) -> T:
    """``fn()`` (a collective outside any program), with a process-group failure raised as a ShardingError."""
    try:
        return fn()
    except RuntimeError as e:
        if is_comm_failure(e):
            raise ShardingError(f"{where} failed: {type(e).__name__}: {_first_line(e)}. Likely cause: {CAUSE}; "
                                f"fix: {FIX}") from e
        raise
