"""Attention: batch and head dims split alike on q, k, v (and the mask broadcasting in).

``fxshard::attention`` and ``fxshard::attention_backward`` (``fxshard/ops/attention.py``: the one
device-neutral node every fxshard trace gives ``F.scaled_dot_product_attention``) split any batch dim of
``q`` (``[*batch, L, E]``, heads being the last batch dim): ``k``, ``v`` and the mask split the same dim
where they have it and are replicated where they broadcast over it (size 1, or missing); with
``enable_gqa`` the kv heads split alike (each rank's query heads read exactly its kv heads' chunk when
both counts divide). In the backward, the gradient of an input replicated over the split (a broadcasting
mask or k/v) is ``P(sum)``. Only splits that divide are offered (``uneven=False``).

CPU's fused kernels ``_scaled_dot_product_flash_attention_for_cpu`` and its backward stay fused in
traced graphs (``tracing/export.py::FUSED_FORWARD``/``FUSED_BACKWARD``). Attention is independent per
batch element and per head, so splitting dim 0 or dim 1 of every ``[B, H, T, E]`` operand (and of
the ``[B, H, T]`` logsumexp) computes each rank's chunk locally. The sequence and head dims are not
split (softmax over keys, causal offsets), nor are Partial inputs taken (a Partial gradient is
reduced once before the backward instead of leaving three Partial gradients behind). With
``dropout_p > 0`` the kernel draws its own mask from the local shape, so only replication is
offered (CPU takes the math path for dropout, which is decomposed, so this does not arise there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    import torch.fx as fx

from ..ops.attention import ATTENTION, ATTENTION_BACKWARD
from ..core.placements import Part, Pl, R, S
from .registry import OpCall, Strategy, register
from ..core.symbolic import Dim, divides
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


def _attention_strategies(call: OpCall, n: int, first: int, backward: bool) -> list[Strategy]:
    """Strategies of ``fxshard::attention`` (``first`` = 0: q, k, v, mask?) and of its backward (``first``
    = 1: grad, q, k, v, mask?; outputs the gradients of q, k, v and, when asked, of the mask)."""
    shapes = call.in_shapes
    q, k, v = shapes[first:first + 3]
    mask = shapes[first + 3] if len(shapes) > first + 3 else None
    scores = (*q[:-1], k[-2])
    n_out = len(call.out_shape) if backward else 1
    k_in = len(shapes)
    res = [Strategy((R,) * k_in, (R,) * n_out if backward else R)]
    for d in range(len(q) - 2):  # every batch dim of q (the heads are the last)
        if not divides(q[d], n):
            continue
        pls: list[Pl] = [S(d)]  # q
        for t in (k, v):
            pl = broadcast_placement(S(d), t[:-2], q[:-2])
            if isinstance(pl, S) and not divides(t[pl.dim], n):
                break
            pls.append(pl)
        else:
            if mask is not None:
                pls.append(broadcast_placement(S(d), mask, scores))
            if not backward:
                res.append(Strategy(tuple(pls), S(d)))
                continue
            grads = tuple(p if isinstance(p, S) else Part() for p in pls)  # a broadcast input's gradient sums
            res.append(Strategy((S(d), *pls), grads[:n_out]))
    return res


@register(ATTENTION, uneven=False)
def attention_rule(call: OpCall, n: int) -> list[Strategy]:
    """q ``[*batch, L, E]``, k ``[*batch, S, E]``, v ``[*batch, S, Ev]`` (+ mask broadcasting to
    ``[*batch, L, S]``) -> out ``[*batch, L, Ev]``: a batch (or head) dim split alike."""
    return _attention_strategies(call, n, 0, backward=False)


@register(ATTENTION_BACKWARD, uneven=False)
def attention_backward_rule(call: OpCall, n: int) -> list[Strategy]:
    """(grad ``[*batch, L, Ev]``, q, k, v, mask?) -> [grad_q, grad_k, grad_v(, grad_mask)]: the forward's
    splits; the gradient of an input broadcasting over the split dim is ``P(sum)``."""
    return _attention_strategies(call, n, 1, backward=True)


# Floating-point work of attention on global shapes, in forward passes (``2 * batch * L * S * (E + Ev)``):
# the backward recomputes the forward and runs the kernel's backward (about 2.5 forwards). The global
# planner prices it (planner/problem.py), so attention replicated on every rank does not look free.
WORK = {ATTENTION: 1.0, ATTENTION_BACKWARD: 3.5}


def flops(node: "fx.Node") -> float:
    """Requires a ``fxshard::attention`` or ``fxshard::attention_backward`` node carrying ``meta["val"]`` on
    its q, k, v. Ensures its floating-point work (``WORK``), hints for symbolic sizes (64 unknown)."""
    from ..core.torch_compat import optimization_hint

    first = 1 if node.target is ATTENTION_BACKWARD else 0
    q, k, v = (node.args[first + i].meta["val"].shape for i in range(3))
    size = lambda d: optimization_hint(d, fallback=64)  # noqa: E731
    batch = 1.0
    for d in q[:-2]:
        batch *= size(d)
    return WORK[node.target] * 2.0 * batch * size(q[-2]) * size(k[-2]) * (size(q[-1]) + size(v[-1]))
