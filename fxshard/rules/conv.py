"""Convolution: split the batch, the output channels, or the input channels (Partial)."""

from __future__ import annotations

import torch

from ..placements import Part, R, S
from ..registry import OpCall, Strategy, register
from ..symbolic import divides

aten = torch.ops.aten


@register(aten.convolution.default)
def conv_rule(call: OpCall, n: int) -> list[Strategy]:
    """``convolution(x[N, C, ...], w[O, C/g, ...], bias[O]?)`` for ``groups == 1``, not transposed."""
    x, w = call.in_shapes[0], call.in_shapes[1]
    has_bias = len(call.in_shapes) > 2
    transposed, groups = call.node.args[6], call.node.args[8]
    b = (R,) if has_bias else ()
    res = [Strategy((R, R) + b, R)]
    if divides(x[0], n):
        res.append(Strategy((S(0), R) + b, S(0)))
    if transposed or groups != 1:
        return res
    if divides(w[0], n):
        res.append(Strategy((R, S(0)) + ((S(0),) if has_bias else ()), S(1)))
    if divides(x[1], n):
        res.append(Strategy((S(1), S(1)) + ((Part(),) if has_bias else ()), Part()))
    return res
