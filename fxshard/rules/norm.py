"""Normalizations: split only over the dims that are not normalized."""

from __future__ import annotations

import torch

from ..placements import R, S
from ..registry import OpCall, Strategy, register
from ..symbolic import divides

aten = torch.ops.aten


@register(aten.native_layer_norm.default)
def layer_norm_rule(call: OpCall, n: int) -> list[Strategy]:
    """``native_layer_norm(x, normalized_shape, w, b, eps) -> (out, mean, rstd)``; w/b replicated."""
    x = call.in_shapes[0]
    k = len(call.in_shapes)
    axis = len(x) - len(call.node.args[1])
    res = [Strategy((R,) * k, (R, R, R))]
    for d in range(axis):
        if divides(x[d], n):
            res.append(Strategy((S(d),) + (R,) * (k - 1), (S(d), S(d), S(d))))
    return res
