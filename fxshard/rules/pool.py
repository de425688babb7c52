"""Pooling and resampling over trailing spatial dims, as one table: batch and channel dims split.

Each op works on the last ``k`` dims of its tensor inputs (``k`` = 1, 2 or 3 spatial dims; inputs
may be batched ``[N, C, *spatial]`` or not ``[C, *spatial]``) and independently on every leading
dim, so splitting a leading dim of every tensor input alike (the input, the incoming gradient, the
saved max indices) splits the outputs there, evenly or not. Averages and interpolations are linear
in their first tensor input (the input, or the gradient for backwards): a ``P(sum)`` there, the
others replicated, gives ``P(sum)``; max pooling backwards are linear in the gradient too.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.placements import Part, R, S
from .registry import OpCall, Strategy, register
from ..core.spec import can_split

aten = torch.ops.aten

# op -> (spatial dims, linear in its first tensor input)
SPATIAL: dict[Any, tuple[int, bool]] = {
    aten.avg_pool2d.default: (2, True),
    aten.avg_pool2d_backward.default: (2, True),
    aten.avg_pool3d.default: (3, True),
    aten.avg_pool3d_backward.default: (3, True),
    aten._adaptive_avg_pool2d.default: (2, True),
    aten._adaptive_avg_pool2d_backward.default: (2, True),
    aten._adaptive_avg_pool3d.default: (3, True),
    aten._adaptive_avg_pool3d_backward.default: (3, True),
    aten.max_pool2d_with_indices.default: (2, False),
    aten.max_pool2d_with_indices_backward.default: (2, True),
    aten.max_pool3d_with_indices.default: (3, False),
    aten.max_pool3d_with_indices_backward.default: (3, True),
    aten.adaptive_max_pool2d.default: (2, False),
    aten.adaptive_max_pool2d_backward.default: (2, True),
    aten.adaptive_max_pool3d.default: (3, False),
    aten.adaptive_max_pool3d_backward.default: (3, True),
    aten.upsample_bilinear2d.default: (2, True),
    aten.upsample_bilinear2d_backward.default: (2, True),
    aten._upsample_bilinear2d_aa.default: (2, True),
    aten._upsample_bilinear2d_aa_backward.default: (2, True),
    # the overloads torch.export keeps for F.interpolate(scale_factor=...) (inference programs)
    aten.upsample_nearest2d.vec: (2, True),
    aten.upsample_bilinear2d.vec: (2, True),
}


@register(list(SPATIAL))
def spatial_rule(call: OpCall, n: int) -> list[Strategy]:
    spatial, linear = SPATIAL[call.node.target]
    k = len(call.in_shapes)
    multi = isinstance(call.out_shape[0], tuple)
    out = (lambda p: (p,) * len(call.out_shape)) if multi else (lambda p: p)
    res = [Strategy((R,) * k, out(R))]
    lead = len(call.in_shapes[0]) - spatial
    for d in range(lead):
        if all(len(s) == lead + spatial and can_split(s[d], n) for s in call.in_shapes):
            res.append(Strategy((S(d),) * k, out(S(d))))
    if linear and not multi:
        res.append(Strategy((Part(),) + (R,) * (k - 1), Part()))
    return res
