"""Convolution: split the batch, the output channels, or the input channels (Partial)."""

from __future__ import annotations

import torch

from ..core.placements import Part, R, S
from .registry import OpCall, Strategy, register
from ..core.symbolic import divides

aten = torch.ops.aten


@register(aten.convolution.default, uneven=False)
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


@register(aten.convolution_backward.default, uneven=False)
def conv_backward_rule(call: OpCall, n: int) -> list[Strategy]:
    """``convolution_backward(grad_out, x, w, ...) -> (grad_x, grad_w, grad_bias)``: the forward's three
    splits seen from the gradients (batch: weight/bias grads Partial; output channels: input grad
    Partial; input channels: bias grad whole)."""
    g, x, w = call.in_shapes[:3]
    transposed, groups = call.node.args[7], call.node.args[9]
    outs = call.out_shape

    def out(*pls):
        return tuple(p if o is not None else None for p, o in zip(pls, outs))

    res = [Strategy((R, R, R), out(R, R, R))]
    if divides(x[0], n):
        res.append(Strategy((S(0), S(0), R), out(S(0), Part(), Part())))
    if transposed or groups != 1:
        return res
    if divides(w[0], n):
        res.append(Strategy((S(1), R, S(0)), out(Part(), S(0), S(0))))
    if divides(x[1], n):
        res.append(Strategy((R, S(1), S(1)), out(S(1), S(1), R)))
    return res
