"""Normalizations: split only over the dims that are not normalized."""

from __future__ import annotations

import torch

from ..placements import Part, R, S
from ..registry import OpCall, Strategy, register
from ..spec import can_split

aten = torch.ops.aten


@register(aten.native_layer_norm.default, uneven=True)
def layer_norm_rule(call: OpCall, n: int) -> list[Strategy]:
    """``native_layer_norm(x, normalized_shape, w, b, eps) -> (out, mean, rstd)``; w/b replicated."""
    x = call.in_shapes[0]
    k = len(call.in_shapes)
    axis = len(x) - len(call.node.args[1])
    res = [Strategy((R,) * k, (R, R, R))]
    for d in range(axis):
        if can_split(x[d], n):
            res.append(Strategy((S(d),) + (R,) * (k - 1), (S(d), S(d), S(d))))
    return res


@register(aten.native_layer_norm_backward.default, uneven=True)
def layer_norm_backward_rule(call: OpCall, n: int) -> list[Strategy]:
    """``native_layer_norm_backward(g, x, normalized_shape, mean, rstd, w?, b?, output_mask)
    -> (grad_x?, grad_w?, grad_b?)``.

    Splitting a non-normalized dim ``d`` of ``g``, ``x``, ``mean`` and ``rstd`` (w/b replicated)
    computes ``grad_x`` split on ``d``, and ``grad_w``/``grad_b`` as this rank's terms of their sums
    over the non-normalized dims: ``P(sum)``. Outputs masked off by ``output_mask`` stay None.
    """
    x = call.in_shapes[1]
    k = len(call.in_shapes)
    axis = len(x) - len(call.node.args[2])
    outs = call.out_shape

    def out(*pls):
        return tuple(p if o is not None else None for p, o in zip(pls, outs))

    res = [Strategy((R,) * k, out(R, R, R))]
    for d in range(axis):
        if can_split(x[d], n):
            res.append(Strategy((S(d),) * 4 + (R,) * (k - 4), out(S(d), Part(), Part())))
    return res
