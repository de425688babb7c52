"""Batched linear algebra: ``linalg_solve_triangular``.

``linalg_solve_triangular(A, B, *, upper, left=True, unitriangular=False)`` solves ``A X = B`` (``X A = B``
when ``left=False``) for every matrix of the broadcast batch dims, ``A`` ``[*, n, n]`` triangular. One
mesh axis admits: all replicated; one batch dim of the output split, each input split there too unless
it broadcasts along it (then replicated); the right-hand sides' free dim (``B``'s last dim when
``left``, else its second to last) split with ``A`` replicated, since every column (row) of ``X`` solves
on its own; and ``B`` ``P(sum)`` with ``A`` replicated giving ``P(sum)`` (``X`` is linear in ``B``). The
system's own dims of ``A`` are never split: a triangular solve reads the whole matrix. Its backward
(another solve, a matmul, a triangular mask of ``A``'s gradient) decomposes to ops with rules.
"""

from __future__ import annotations

import torch

from ..core.placements import Part, Pl, R, S
from .registry import OpCall, Strategy, all_r, register, split_outers
from ..core.spec import can_split
from .pointwise import dim_map

aten = torch.ops.aten

__all__ = ["solve_triangular_rule"]


@register(aten.linalg_solve_triangular.default)
def solve_triangular_rule(call: OpCall, n: int) -> list[Strategy]:
    """Strategies of ``linalg_solve_triangular`` on one mesh axis of size ``n`` (see the module docstring).

    Requires: ``call`` a call of ``aten.linalg_solve_triangular.default`` with tensor inputs ``A``, ``B``.
    Ensures: every strategy's output on each rank is that rank's piece of the global solution."""
    a_shape, b_shape = call.in_shapes[0], call.in_shapes[1]
    out = call.out_shape
    left = call.kwargs.get("left", True)
    res = [Strategy(all_r(2), R)]
    batch = len(out) - 2
    maps = [dim_map(a_shape[:-2], out[:batch]), dim_map(b_shape[:-2], out[:batch])]
    for d in range(batch):
        for o in split_outers((p, m[d]) for m, p in zip(maps, call.in_pls)):
            if not can_split(out[d], n, o):
                continue
            ins: list[Pl] = [S(m[d], o) if m[d] is not None else R for m in maps]
            res.append(Strategy(tuple(ins), S(d, o)))
    free = len(out) - 1 if left else len(out) - 2  # the dim holding B's independent right-hand sides
    b_free = len(b_shape) - (len(out) - free)
    for o in split_outers([(call.in_pls[1], b_free)]):
        if can_split(out[free], n, o):
            res.append(Strategy((R, S(b_free, o)), S(free, o)))
    res.append(Strategy((R, Part()), Part()))
    return res
