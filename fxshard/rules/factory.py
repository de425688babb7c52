"""Tensor factories. Fresh tensors are replicated (their consumers slice them for free);
``*_like`` factories follow their input's split since they only read its shape."""

from __future__ import annotations

import torch

from ..core.placements import Part, R, S
from .registry import OpCall, Strategy, outer_of, register

aten = torch.ops.aten

FRESH = [
    aten.full.default, aten.arange.start_step, aten.arange.default, aten.arange.start,
    aten.scalar_tensor.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format,
    aten.empty_strided.default, aten.empty_permuted.default, aten.eye.default, aten.randn.default, aten.rand.default,
]
LIKE = [
    aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
    aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default,
]


@register(FRESH)
def fresh_rule(call: OpCall, n: int) -> list[Strategy]:
    return [Strategy((R,) * len(call.in_shapes), R)]


@register(LIKE)
def like_rule(call: OpCall, n: int) -> list[Strategy]:
    """Same split as the input for ``*_like`` (shape follows the input); new_* sizes are explicit."""
    if call.node.target in (aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default):
        return [Strategy((call.in_pls[0],), R)]
    res = [Strategy((R,), R)]
    for op in ("sum", "max", "min"):
        res.append(Strategy((Part(op),), R))
    cur = call.in_pls[0]
    for d in range(len(call.in_shapes[0])):
        o = outer_of(cur, d)
        res.append(Strategy((S(d, o),), S(d, o)))
    return res
