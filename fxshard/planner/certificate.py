"""The global planner's shortcut: a certificate that the greedy plan is a cheapest plan of a
:class:`~fxshard.planner.problem.Problem` (:func:`greedy_is_optimal`), so the MILP can be skipped."""

from __future__ import annotations

import itertools
import math
from typing import Optional

from .formulate import LOG, UNIT, compute_cost, layouts, plan_cost
from .problem import Layout, Problem, ValueKey, links_of, price

__all__ = ["greedy_is_optimal", "MAX_COMBOS"]

MAX_COMBOS = 4096  # N-D choices of one node the optimality certificate enumerates (beyond: not certified)
ROUNDING = 1e-9  # relative slack of the certificate's comparison (float sums in a different order)


def greedy_is_optimal(problem: Problem, max_combos: int = MAX_COMBOS) -> bool:
    """Whether the greedy plan is provably a cheapest plan of ``problem``, so the MILP can be skipped.

    Ensures: True only if no plan of the solver's candidate space (every node's per-axis choices,
    legal or not) has a lower :func:`plan_cost` than the greedy plan (up to a relative ``ROUNDING``
    of float sums); then :func:`solve_problem`, which keeps the greedy plan unless a solved one is
    strictly cheaper, would return the greedy plan too. False means "not proven", not "improvable".

    The proof is a lower bound separable per node, compared with the greedy cost. A value's layout
    changes cost at least the dearest one (the set of changes is paid once each), hence at least any
    weighted average of its consumers' changes with weights summing to 1. A term whose two sides are
    each decided by one node at most is kept: a producer with one layout in every candidate (a
    parameter, an input, a pinned constraint) or a consumer with one need (a required output, a pinned
    constraint); a term between two undecided sides is bounded by 0. So every plan costs at least
    ``constant + sum over nodes of min over its N-D choices of (its compute + its kept terms)``. The
    weights follow the greedy plan: all on the consumers of the one layout it changes a value to. The
    certificate holds iff every byte the greedy plan moves is a change that a fixed side forces and
    each node's greedy choice is its cheapest given those terms: e.g. Megatron styles, whose
    boundaries pin every layout around the matmuls. Cost: one pass over the greedy plan, then each
    node's N-D choices (a node with more than ``max_combos`` of them is not certified); the first
    slack beyond rounding stops it.
    """
    k = len(problem.sizes)
    greedy = {name: nv.greedy for name, nv in problem.nodes.items()}
    lay_g = layouts(problem, greedy)
    total = plan_cost(problem, greedy)
    tol = ROUNDING * total

    def one(options: list[set]) -> Optional[Layout]:
        return tuple(next(iter(o)) for o in options) if all(len(o) == 1 for o in options) else None

    def produced(u: ValueKey) -> Optional[Layout]:
        return one([set(problem.outputs_of(u, a)) for a in range(k)])

    # per value: its demands, each (greedy need, the need if no choice changes it, the deciding node, "in"/"out", index)
    demands: dict[ValueKey, list[tuple[Layout, Optional[Layout], Optional[str], str, int]]] = {}
    for name, nv in problem.nodes.items():
        for slot, u in enumerate(nv.inputs):
            need_g = tuple(nv.axes[a][i].inputs[slot] for a, i in enumerate(nv.greedy))
            demands.setdefault(u, []).append(
                (need_g, one([{c.inputs[slot] for c in nv.axes[a]} for a in range(k)]), name, "in", slot))
    for u, lay in problem.required:
        demands.setdefault(u, []).append((lay, lay, None, "", 0))
    for u, name in problem.tied:
        demands.setdefault(u, []).append((lay_g[(name, 0)], produced((name, 0)), name, "out", 0))
    constant = 0.0
    # per node: (weight, bytes, the fixed side's layout, "in"/"out", index, whether the fixed side is the source,
    # the links the value is priced on)
    terms: dict[str, list[tuple[float, float, Layout, str, int, bool, tuple]]] = {}
    for u, ds in demands.items():
        lk = links_of(problem, u)
        costly = {d[0] for d in ds if price(lay_g[u], d[0], problem.nbytes[u], problem.sizes, lk) > 0}
        if len(costly) > 1:  # the greedy plan pays two changes of u, the bound counts one
            LOG.debug("greedy plan not certified: %s is changed to %d layouts", u, len(costly))
            return False
        chosen = [d for d in ds if d[0] in costly] or ds
        w, src = 1.0 / len(chosen), produced(u)
        for _, need, name, kind, idx in chosen:
            if src is not None and need is not None:
                constant += w * price(src, need, problem.nbytes[u], problem.sizes, lk) / UNIT
            elif src is not None:
                terms.setdefault(name, []).append((w, problem.nbytes[u], src, kind, idx, True, lk))
            elif need is not None:
                terms.setdefault(u[0], []).append((w, problem.nbytes[u], need, "out", u[1], False, lk))

    def local(name: str, picks: tuple[int, ...]) -> float:
        nv = problem.nodes[name]
        chosen = [nv.axes[a][i] for a, i in enumerate(picks)]
        cost = compute_cost(problem, nv, 0, chosen[0], picks)
        for w, nbytes, fixed, kind, idx, fixed_is_src, lk in terms.get(name, ()):
            mine = tuple((c.inputs if kind == "in" else c.outputs)[idx] for c in chosen)
            cost += w * (price(fixed, mine, nbytes, problem.sizes, lk) if fixed_is_src
                         else price(mine, fixed, nbytes, problem.sizes, lk)) / UNIT
        return cost

    lower = constant + sum(local(name, nv.greedy) for name, nv in problem.nodes.items())
    slack = total - lower  # >= 0: what the greedy plan pays beyond the bound at its own choices
    if slack > tol:
        LOG.debug("greedy plan not certified: it pays %.4g between undecided sides", slack * UNIT)
        return False
    for name, nv in problem.nodes.items():
        if not nv.flops and name not in terms:
            continue
        if math.prod(len(ax) for ax in nv.axes) > max_combos:
            LOG.debug("greedy plan not certified: %s has more than %d choices", name, max_combos)
            return False
        at_greedy = local(name, nv.greedy)
        slack += at_greedy - min(local(name, picks) for picks in itertools.product(*(range(len(ax)) for ax in nv.axes)))
        if slack > tol:
            LOG.debug("greedy plan not certified: %s could be %.4g cheaper", name, slack * UNIT)
            return False
    return True

