"""Contractions, each written as an einsum string.

For one mesh axis an einsum admits: all replicated; one index letter split
(inputs holding it split there, the output split there or, for a contracted
letter, ``P(sum)``); and, because contractions are multilinear, one ``P(sum)``
input with the others replicated giving ``P(sum)``. ``addmm`` adds a bias that
broadcasts into the output and follows the output's placement.
"""

from __future__ import annotations

import torch

from ..core.placements import Part, Pl, R, S
from .registry import OpCall, Strategy, all_r, register, split_outers
from ..core.spec import can_split
from .pointwise import broadcast_placement

aten = torch.ops.aten

EINSUMS = {
    aten.mm.default: "mk,kn->mn",
    aten.bmm.default: "bmk,bkn->bmn",
    aten.mv.default: "mk,k->m",
    aten.dot.default: "k,k->",
}


def einsum_strategies(eq: str, call: OpCall, n: int, first: int = 0) -> list[Strategy]:
    """Strategies for ``eq`` whose operands are tensor inputs ``first``, ``first+1``, ...."""
    lhs, out = eq.split("->")
    terms = lhs.split(",")
    k = len(call.in_shapes)
    sizes = {}
    for t, shape in zip(terms, call.in_shapes[first:]):
        sizes.update(zip(t, shape))
    res = [Strategy(all_r(k), R)]
    for letter in dict.fromkeys(lhs.replace(",", "")):
        dims = [(p, t.index(letter) if letter in t else None) for t, p in zip(terms, call.in_pls[first:])]
        for o in split_outers(dims):
            if not can_split(sizes[letter], n, o):
                continue
            ins: list[Pl] = [R] * k
            for i, t in enumerate(terms):
                if letter in t:
                    ins[first + i] = S(t.index(letter), o)
            outp = S(out.index(letter), o) if letter in out else Part()
            res.append(Strategy(tuple(ins), outp))
    for i in range(len(terms)):
        ins = [R] * k
        ins[first + i] = Part()
        res.append(Strategy(tuple(ins), Part()))
    return res


def _einsum_rule(call: OpCall, n: int) -> list[Strategy]:
    return einsum_strategies(EINSUMS[call.node.target], call, n)


register(list(EINSUMS), _einsum_rule)


# ``beta * bias + alpha * contraction``: the bias broadcasts into the output
ADD_EINSUMS = {
    aten.addmm.default: "mk,kn->mn",
    aten.addmv.default: "mk,k->m",
    aten.addbmm.default: "bmk,bkn->mn",
    aten.baddbmm.default: "bmk,bkn->bmn",
}


@register(list(ADD_EINSUMS))
def add_einsum_rule(call: OpCall, n: int) -> list[Strategy]:
    """``bias + contraction``: the contraction's strategies, with the bias following the output placement."""
    res = []
    for st in einsum_strategies(ADD_EINSUMS[call.node.target], call, n, first=1):
        bias = broadcast_placement(st.output, call.in_shapes[0], call.out_shape)
        res.append(Strategy((bias,) + st.inputs[1:], st.output))
    return res
