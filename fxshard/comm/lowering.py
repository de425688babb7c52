"""Rank-dependent lowerings: local rewrites a strategy needs beyond its placements.

A rule that offers such a strategy gives it a :class:`Lowering` (``Strategy(..., lowering=L)``),
defined next to the rule (``rules/embedding.py``: masked lookups; ``rules/reduction.py``: a mean
over a split dim; ``rules/random.py``: a global draw). The localize pass calls
``L.fn(graph, node, ctx, axes)`` once per node, after its shape arguments are local, with
``axes`` the mesh axes whose strategy carries ``L``. The helpers below are what lowerings share.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from .collectives import Emitter
from ..core.context import ShardContext
from ..core.errors import ShardingError
from ..core.ir import INSERTED_KEY, META_KEY
from ..core.spec import Spec, chunk, chunk_index, is_uneven, shard_factor
from ..core.symbolic import is_concrete

aten = torch.ops.aten

__all__ = ["Lowering", "LowerFn", "chunk_start", "shifted_index", "follow_with", "zero_misses_after", "set_arg"]

LowerFn = Callable[[fx.Graph, fx.Node, ShardContext, list[int]], None]


class Lowering(str):
    """A named lowering (the name is what ``explain`` shows and what compares equal) and its function
    ``fn(graph, node, ctx, axes)``, which rewrites ``node`` into this rank's code in place (it may
    replace and erase the node)."""

    fn: LowerFn

    def __new__(cls, name: str, fn: LowerFn) -> "Lowering":
        obj = super().__new__(cls, name)
        obj.fn = fn
        return obj


def chunk_start(spec: Spec, dim: int, ctx: ShardContext) -> tuple[Any, Any]:
    """(global index of this rank's first element along ``dim``, local size of ``dim``)."""
    m = ctx.mesh
    ld = spec.local_shape(m.sizes, m.coords)[dim]
    size, f = spec.shape[dim], shard_factor(spec.placements, m.sizes, dim)
    idx = chunk_index(spec.placements, m.sizes, m.coords, dim)
    if is_uneven(size, f):
        return chunk(int(size), f, idx)[0], ld
    return idx * ld, ld


def shifted_index(e: Emitter, node: fx.Node, table: fx.Node, idx: fx.Node, dim: int, ctx: ShardContext,
                  *, negative_wraps: bool = False) -> tuple[fx.Node, fx.Node]:
    """(index into this rank's range of a table split on ``dim``, miss mask).

    Requires static global and local sizes of ``dim``. With ``negative_wraps``, an index in
    ``[-size, 0)`` counts from the end of the global dim, as eager ``index_put`` and ``x[idx]`` read it
    (wrapping against this rank's size would pick the wrong row). Ensures: a miss (in the global range,
    on another rank) becomes 0; an index outside the global range stays as given, which is outside
    this rank's range too, so the local op raises on it as eager does rather than every rank skipping it.
    """
    spec = table.meta[META_KEY]
    start, ld = chunk_start(spec, dim, ctx)
    size = spec.shape[dim]
    if not (is_concrete(ld) and is_concrete(size)):
        raise ShardingError(f"{node.name}: a symbolic split size in a masked lookup is not supported; "
                            f"give the split table dim a static size")
    ld, size = int(ld), int(size)
    given = idx
    if negative_wraps:
        idx = e.op(aten.where.self, e.op(aten.lt.Scalar, idx, 0), e.op(aten.add.Scalar, idx, size), idx)
    shifted = e.op(aten.sub.Tensor, idx, int(start))
    miss = e.op(aten.logical_or.default, e.op(aten.lt.Scalar, shifted, 0), e.op(aten.ge.Scalar, shifted, ld))
    outside = e.op(aten.logical_or.default, e.op(aten.lt.Scalar, idx, 0), e.op(aten.ge.Scalar, idx, size))
    return e.op(aten.where.self, outside, given, e.op(aten.masked_fill.Scalar, shifted, miss, 0)), miss


def follow_with(g: fx.Graph, node: fx.Node, target: Any, *args: Any) -> fx.Node:
    """Insert ``target(node, *args)`` right after ``node`` and make every other user read it instead."""
    with g.inserting_after(node):
        out = g.call_function(target, (node, *args))
    out.meta[INSERTED_KEY] = True
    out.meta["val"] = node.meta.get("val")
    out.meta[META_KEY] = node.meta.get(META_KEY)
    for user in list(node.users):
        if user is not out:
            user.replace_input_with(node, out)
    return out


def zero_misses_after(g: fx.Graph, node: fx.Node, miss: fx.Node, unsqueeze: bool) -> None:
    """Replace ``node``'s uses by ``node`` with the positions in ``miss`` zeroed."""
    mask = Emitter(g, node, {}).op(aten.unsqueeze.default, miss, -1) if unsqueeze else miss
    follow_with(g, node, aten.masked_fill.Scalar, mask, 0.0)


def set_arg(node: fx.Node, i: int, value: Any) -> None:
    args = list(node.args)
    args[i] = value
    node.args = tuple(args)
