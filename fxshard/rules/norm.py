"""Normalizations: split only over the dims that are not normalized."""

from __future__ import annotations

import torch

from ..core.placements import Part, R, S
from .registry import OpCall, Strategy, register
from ..core.spec import can_split

aten = torch.ops.aten


@register(aten.native_layer_norm.default)
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


@register(aten.native_layer_norm_backward.default)
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


@register(aten.native_group_norm.default)
def group_norm_rule(call: OpCall, n: int) -> list[Strategy]:
    """``native_group_norm(x[N, C, *], w?, b?, N, C, HxW, groups, eps) -> (out, mean[N, G], rstd[N, G])``:
    samples are normalized independently, so the batch splits."""
    k = len(call.in_shapes)
    res = [Strategy((R,) * k, (R, R, R))]
    if can_split(call.in_shapes[0][0], n):
        res.append(Strategy((S(0),) + (R,) * (k - 1), (S(0), S(0), S(0))))
    return res


@register(aten.native_group_norm_backward.default)
def group_norm_backward_rule(call: OpCall, n: int) -> list[Strategy]:
    """``native_group_norm_backward(g, x, mean, rstd, w?, N, C, HxW, groups, output_mask)``: the batch
    split gives ``grad_x`` split and the weight/bias gradients as this rank's terms (``P(sum)``)."""
    k = len(call.in_shapes)
    outs = call.out_shape

    def out(*pls):
        return tuple(p if o is not None else None for p, o in zip(pls, outs))

    res = [Strategy((R,) * k, out(R, R, R))]
    if can_split(call.in_shapes[1][0], n):
        res.append(Strategy((S(0),) * 4 + (R,) * (k - 4), out(S(0), Part(), Part())))
    return res


@register(aten._native_batch_norm_legit_no_training.default)
def batch_norm_inference_rule(call: OpCall, n: int) -> list[Strategy]:
    """``_native_batch_norm_legit_no_training(x[N, C, *], w?, b?, running_mean, running_var, momentum,
    eps) -> (out, [0], [0])``: statistics are given per channel, so any dim but the channel dim splits."""
    k = len(call.in_shapes)
    res = [Strategy((R,) * k, (R, R, R))]
    for d, size in enumerate(call.in_shapes[0]):
        if d != 1 and can_split(size, n):
            res.append(Strategy((S(d),) + (R,) * (k - 1), (S(d), R, R)))
    return res


@register(aten._native_batch_norm_legit_functional.default)
def batch_norm_training_rule(call: OpCall, n: int) -> list[Strategy]:
    """``_native_batch_norm_legit_functional(x[N, C, *], w?, b?, running_mean[C], running_var[C], training,
    momentum, eps) -> (out, save_mean[C], save_rstd[C], new_running_mean[C], new_running_var[C])``: each
    channel's statistics are its own, so the channel dim splits (with every per-channel tensor)."""
    k = len(call.in_shapes)
    res = [Strategy((R,) * k, (R,) * 5)]
    if len(call.in_shapes[0]) > 1 and can_split(call.in_shapes[0][1], n):
        res.append(Strategy((S(1),) + (S(0),) * (k - 1), (S(1),) + (S(0),) * 4))
    return res
