"""Embedding lookups and gathers along a split dim become masked local lookups + ``P(sum)``."""

from __future__ import annotations

import torch

from ..placements import Part, R, S
from ..registry import OpCall, Strategy, norm_dim, register
from ..symbolic import divides

aten = torch.ops.aten


@register(aten.embedding.default)
def embedding_rule(call: OpCall, n: int) -> list[Strategy]:
    """``embedding(weight[V, D], idx)``: split D (colwise), split V (masked lookup, Partial),
    or split the indices (batch)."""
    (v, d), idx = call.in_shapes[0], call.in_shapes[1]
    out_nd = len(call.out_shape)
    res = [Strategy((R, R), R)]
    if divides(d, n):
        res.append(Strategy((S(1), R), S(out_nd - 1)))
    if divides(v, n):
        res.append(Strategy((S(0), R), Part(), lowering="masked_embedding"))
    cur = call.in_pls[1]
    for i, size in enumerate(idx):
        o = cur.outer if isinstance(cur, S) and cur.dim == i else 1
        if divides(size, o * n):
            res.append(Strategy((R, S(i, o)), S(i, o)))
    return res


@register(aten.gather.default)
def gather_rule(call: OpCall, n: int) -> list[Strategy]:
    """``gather(x, dim, index)``: split a non-gather dim of both, or split the gather dim of x
    (masked gather of the local range, Partial)."""
    x, index = call.in_shapes[0], call.in_shapes[1]
    dim = norm_dim(call.node.args[1], len(x))
    res = [Strategy((R, R), R)]
    for d in range(len(x)):
        if d == dim:
            if divides(x[d], n):
                res.append(Strategy((S(d), R), Part(), lowering="masked_gather"))
        elif divides(index[d], n) and divides(x[d], n) and str(x[d]) == str(index[d]):
            res.append(Strategy((S(d), S(d)), S(d)))
    return res
