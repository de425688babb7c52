"""Fused attention: batch and head dims split alike on q, k, v (and the mask broadcasting in).

CPU's fused kernels ``_scaled_dot_product_flash_attention_for_cpu`` and its backward stay fused in
traced graphs (``passes/trace.py::FUSED_FORWARD``/``FUSED_BACKWARD``). Attention is independent per
batch element and per head, so splitting dim 0 or dim 1 of every ``[B, H, T, E]`` operand (and of
the ``[B, H, T]`` logsumexp) computes each rank's chunk locally. The sequence and head dims are not
split (softmax over keys, causal offsets), nor are Partial inputs taken (a Partial gradient is
reduced once before the backward instead of leaving three Partial gradients behind). With
``dropout_p > 0`` the kernel draws its own mask from the local shape, so only replication is
offered (CPU takes the math path for dropout, which is decomposed, so this does not arise there).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..placements import Pl, R, S
from ..registry import OpCall, Strategy, register
from ..symbolic import Dim, divides
from .pointwise import broadcast_placement

aten = torch.ops.aten


def _split_strategies(call: OpCall, n: int, n_split: int, q: Sequence[Dim], n_out: int,
                      dropout_p: float) -> list[Strategy]:
    """All-replicated, and batch/head splits of the first ``n_split`` tensor inputs (each holding B, H
    as dims 0, 1); the remaining tensor inputs are masks broadcasting into ``q``'s shape."""
    k = len(call.in_shapes)
    res = [Strategy((R,) * k, (R,) * n_out)]
    if dropout_p:
        return res
    for d in (0, 1):
        if all(divides(s[d], n) for s in call.in_shapes[:n_split]):
            mask: tuple[Pl, ...] = tuple(broadcast_placement(S(d), s, q) for s in call.in_shapes[n_split:])
            res.append(Strategy((S(d),) * n_split + mask, (S(d),) * n_out))
    return res


@register(aten._scaled_dot_product_flash_attention_for_cpu.default, uneven=False)
def sdpa_rule(call: OpCall, n: int) -> list[Strategy]:
    """q/k/v ``[B, H, T, E]`` (+ mask) -> (out ``[B, H, T, E]``, logsumexp ``[B, H, T]``)."""
    return _split_strategies(call, n, 3, call.in_shapes[0], 2, call.arg(3, "dropout_p", 0.0))


@register(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, uneven=False)
def sdpa_backward_rule(call: OpCall, n: int) -> list[Strategy]:
    """(grad_out, q, k, v, out ``[B, H, T, E]``, logsumexp ``[B, H, T]``, mask?) -> (grad_q, grad_k,
    grad_v): the forward's batch and head splits."""
    return _split_strategies(call, n, 6, call.in_shapes[1], 3, call.arg(6, "dropout_p", 0.0))
