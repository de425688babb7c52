"""Reductions over dims: a split reduced dim becomes a Partial of the matching op.

Table: op -> (which Partial a split reduced dim yields, which Partial input the
op keeps). ``mean`` yields ``P(sum)`` through a lowering that divides the local
sum by the global count. Ops whose split reduced dims have no Partial form
(``var``, ``any``, ``argmax``...) only reduce over unsplit dims.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..placements import Part, R, S
from ..registry import OpCall, Strategy, norm_dims, register
from ..spec import can_split

aten = torch.ops.aten

# op -> (partial produced by splitting a reduced dim, partial op the reduction passes through)
REDUCTIONS: dict = {
    aten.sum.dim_IntList: ("sum", "sum"),
    aten.sum.default: ("sum", "sum"),
    aten.mean.dim: ("sum", "sum"),
    aten.mean.default: ("sum", "sum"),
    aten.amax.default: ("max", "max"),
    aten.amin.default: ("min", "min"),
    aten.var.correction: (None, None),
    aten.var.dim: (None, None),
    aten.any.dim: (None, None),
    aten.any.dims: (None, None),
    aten.any.default: (None, None),
    aten.argmax.default: (None, None),
    aten.argmin.default: (None, None),
    aten.prod.dim_int: (None, None),
    aten.cumsum.default: (None, None),
}
SCAN = {aten.cumsum.default}  # keep the dim; only the scanned dim must stay whole


def reduced_dims(call: OpCall) -> tuple[list[int], bool]:
    """(reduced dims, keepdim) read from the node's arguments."""
    ndim = len(call.in_shapes[0])
    t = call.node.target
    a = call.node.args
    kw = call.node.kwargs
    if t in (aten.sum.default, aten.mean.default, aten.any.default):
        return list(range(ndim)), False
    if t in SCAN:
        return norm_dims(a[1], ndim), True
    dims = a[1] if len(a) > 1 else kw.get("dim")
    keep = a[2] if len(a) > 2 and isinstance(a[2], bool) else kw.get("keepdim", False)
    if t is aten.var.correction:
        keep = kw.get("keepdim", a[3] if len(a) > 3 else False)
    return norm_dims(dims, ndim), bool(keep)


def out_dim(d: int, dims: list[int], keep: bool) -> Optional[int]:
    if d in dims:
        return None if not keep else d
    return d if keep else d - sum(1 for r in dims if r < d)


@register(list(REDUCTIONS), uneven=True)
def reduction_rule(call: OpCall, n: int) -> list[Strategy]:
    split_partial, keep_partial = REDUCTIONS[call.node.target]
    dims, keep = reduced_dims(call)
    k = len(call.in_shapes)
    rest = (R,) * (k - 1)
    shape = call.in_shapes[0]
    res = [Strategy((R,) + rest, R)]
    cur = call.in_pls[0]
    for d, size in enumerate(shape):
        outers = {1} | ({cur.outer} if isinstance(cur, S) and cur.dim == d else set())
        for o in sorted(outers):
            if not can_split(size, n, o):
                continue
            if d in dims and call.node.target not in SCAN:
                if split_partial is not None:
                    lowering = "mean_as_sum" if call.node.target in (aten.mean.dim, aten.mean.default) else None
                    res.append(Strategy((S(d, o),) + rest, Part(split_partial), lowering))
            elif d not in dims:
                res.append(Strategy((S(d, o),) + rest, S(out_dim(d, dims, keep), o)))
    if keep_partial is not None:
        res.append(Strategy((Part(keep_partial),) + rest, Part(keep_partial)))
    return res
