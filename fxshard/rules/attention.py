"""Fused attention: batch and head dims split alike on q, k, v (and the mask broadcasting in)."""

from __future__ import annotations

import torch

from ..placements import R, S
from ..registry import OpCall, Strategy, register
from ..symbolic import divides
from .pointwise import broadcast_placement

aten = torch.ops.aten


@register(aten._scaled_dot_product_flash_attention_for_cpu.default)
def sdpa_rule(call: OpCall, n: int) -> list[Strategy]:
    """q/k/v ``[B, H, T, E]`` -> (out ``[B, H, T, E]``, logsumexp ``[B, H, T]``)."""
    q = call.in_shapes[0]
    k = len(call.in_shapes)
    res = [Strategy((R,) * k, (R, R))]
    for d in (0, 1):
        if all(divides(s[d], n) for s in call.in_shapes[:3]):
            mask = tuple(broadcast_placement(S(d), s, q) for s in call.in_shapes[3:])
            res.append(Strategy((S(d), S(d), S(d)) + mask, (S(d), S(d))))
    return res
