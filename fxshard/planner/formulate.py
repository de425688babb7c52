"""The global planner's MILP over a :class:`~fxshard.planner.problem.Problem`: the exact cost of a plan
(:func:`plan_cost`), its formulation and the rounds that solve it (:func:`solve_problem`).

The formulation (docs/solver_design.md): per node and mesh axis, a binary per strategy its rule
admits, exactly one chosen; pairs of per-axis strategies that split a dim illegally together
exclude each other. Per value, axis and consumer, the producer's output placement ``q`` and the
consumer's required placement ``p`` are coupled by ``e[q, p]`` with both marginals (the local
polytope, tight on chains and trees); ``z[q, p] >= e[q, p]`` over all consumers of the value pays
``price(q -> p)`` once. HiGHS solves it through ``scipy.optimize.milp``, in a child process (``fxshard.planner.milp``).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Optional

from . import milp
from ..core.errors import NoLegalPlanError, NoPlanError, ShardingError
from ..core.placements import Pl, S
from .problem import AxisChoice, Layout, NodeVars, Problem, ValueKey, links_of, price

__all__ = ["UNIT", "LOG", "compute_cost", "plan_cost", "layouts", "solve_problem"]

LOG = logging.getLogger("fxshard.planner.solve")  # the global planner's logger (the stage's name), for every module of it
UNIT = float(2 ** 20)  # objective in MiB-equivalents: keeps HiGHS's tolerances meaningful
TIE = 1.0 / UNIT  # one byte-equivalent off per greedy choice: equal-cost plans keep it, no real saving is lost
MIN_COST = 1e-6  # a priced step costs at least ~1 byte-equivalent (HiGHS ignores smaller costs)
FLOPS_PER_BYTE = 1000.0  # compute priced against communication: flops a device does while its link moves a byte
MAX_ROUNDS = 20  # re-solves that exclude a combination of per-axis choices found illegal (3+ axes)
PATIENCE = 2  # patient rounds in a row without a real improvement (STALL) that end the search
STALL = 1e-6  # relative: less is the greedy tie-break's order of magnitude, not a better plan


@dataclass
class _Model:
    cost: list[float] = field(default_factory=list)
    integer: list[int] = field(default_factory=list)
    lb: list[float] = field(default_factory=list)
    ub: list[float] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    cols: list[int] = field(default_factory=list)
    coef: list[float] = field(default_factory=list)
    row_lb: list[float] = field(default_factory=list)
    row_ub: list[float] = field(default_factory=list)

    def var(self, cost: float, integer: bool, lb: float = 0.0, ub: float = 1.0) -> int:
        self.cost.append(cost)
        self.integer.append(int(integer))
        self.lb.append(lb)
        self.ub.append(ub)
        return len(self.cost) - 1

    def row(self, terms: list[tuple[int, float]], lo: float, hi: float) -> None:
        r = len(self.row_lb)
        for c, v in terms:
            self.rows.append(r)
            self.cols.append(c)
            self.coef.append(v)
        self.row_lb.append(lo)
        self.row_ub.append(hi)


def _axis_price(problem: Problem, u: ValueKey, a: int, q: Pl, p: Pl, context: dict[ValueKey, Layout]) -> float:
    """``price`` of changing value ``u``'s placement on axis ``a`` alone, its other axes as in ``context``."""
    lay = context[u]
    return price(lay[:a] + (q,) + lay[a + 1:], lay[:a] + (p,) + lay[a + 1:], problem.nbytes[u], problem.sizes,
                 links_of(problem, u)) / UNIT


def compute_cost(problem: Problem, nv: NodeVars, a: int, c: AxisChoice, picked: tuple[int, ...]) -> float:
    """The contraction work this rank does, in the objective's unit: the op's flops divided by each mesh
    axis on which the choice (``c`` on axis ``a``, ``picked`` on the others) splits an input or output.
    Without it, replicating a matmul (gathering its inputs) would look cheaper than Megatron's all-reduce."""
    if not nv.flops or c.strategy is None:
        return 0.0
    work = nv.flops
    for b, n in enumerate(problem.sizes):
        cb = c if b == a else nv.axes[b][picked[b]]
        if any(isinstance(p, S) for p in cb.inputs + cb.outputs):
            work /= n
    return work / FLOPS_PER_BYTE / UNIT


def plan_cost(problem: Problem, picks: dict[str, tuple[int, ...]]) -> float:
    """The exact objective of a plan: every distinct layout change of every value priced once on all
    axes together (``price``), plus the contractions' compute."""
    out = layouts(problem, picks)
    needs: dict[ValueKey, set] = {}
    total = 0.0
    for name, nv in problem.nodes.items():
        chosen = [nv.axes[a][i] for a, i in enumerate(picks[name])]
        total += compute_cost(problem, nv, 0, chosen[0], picks[name])
        for slot, u in enumerate(nv.inputs):
            needs.setdefault(u, set()).add(tuple(c.inputs[slot] for c in chosen))
    for u, lay in problem.required:
        needs.setdefault(u, set()).add(lay)
    for u, name in problem.tied:
        needs.setdefault(u, set()).add(out[(name, 0)])
    for u, lays in needs.items():
        total += sum(price(out[u], p, problem.nbytes[u], problem.sizes, links_of(problem, u)) for p in lays) / UNIT
    return total


def layouts(problem: Problem, picks: dict[str, tuple[int, ...]]) -> dict[ValueKey, Layout]:
    """Every value's layout under ``picks``."""
    lay = dict(problem.greedy)
    lay.update(problem.fixed)
    for name, nv in problem.nodes.items():
        chosen = [nv.axes[a][i] for a, i in enumerate(picks[name])]
        for j in range(len(chosen[0].outputs)):
            if chosen[0].outputs[j] is not None:
                lay[(name, j)] = tuple(c.outputs[j] for c in chosen)
    return lay


def _formulate(problem: Problem, context: dict[ValueKey, Layout], picks: dict[str, tuple[int, ...]]
               ) -> tuple[_Model, dict[str, list[list[int]]]]:
    """Variables, objective and rows (module doc); the other axes of a value are priced as ``context``
    lays it out, those of a contraction's compute as ``picks`` chose."""
    m = _Model()
    k = len(problem.sizes)
    x: dict[str, list[list[int]]] = {}
    for name, nv in problem.nodes.items():
        rep = problem.shared.get(name)
        if rep is not None:  # the representative's columns, which pay this instance's compute and tie too
            x[name] = x[rep]
            for a in range(k):
                for i, c in enumerate(nv.axes[a]):
                    m.cost[x[name][a][i]] += compute_cost(problem, nv, a, c, picks[name])
                m.cost[x[name][a][nv.greedy[a]]] -= TIE
            continue
        x[name] = [[m.var(compute_cost(problem, nv, a, c, picks[name]), True) for c in nv.axes[a]] for a in range(k)]
        for a in range(k):
            m.row([(i, 1.0) for i in x[name][a]], 1.0, 1.0)
            m.cost[x[name][a][nv.greedy[a]]] -= TIE
        for a, i, b, j in nv.invalid:
            m.row([(x[name][a][i], 1.0), (x[name][b][j], 1.0)], 0.0, 1.0)
    # per value and axis, its consumers: the x columns needing each placement ([] = needed unconditionally)
    consumers: dict[tuple[ValueKey, int], list[dict[Pl, list[int]]]] = {}
    for name, nv in problem.nodes.items():
        for slot, u in enumerate(nv.inputs):
            for a in range(k):
                by_pl: dict[Pl, list[int]] = {}
                for i, c in enumerate(nv.axes[a]):
                    by_pl.setdefault(c.inputs[slot], []).append(x[name][a][i])
                consumers.setdefault((u, a), []).append(by_pl)
    for u, lay in problem.required:
        for a in range(k):
            consumers.setdefault((u, a), []).append({lay[a]: []})
    for u, name in problem.tied:
        for a in range(k):
            consumers.setdefault((u, a), []).append(
                {p: [x[name][a][i] for i in idx] for p, idx in problem.outputs_of((name, 0), a).items()})
    # an edge system equal to one built before (same columns, same prices) is that one again: its
    # payments are counted once more instead of repeating its variables and rows (exact: the copies are
    # independent given the x columns, so each has the same optimum)
    systems: dict[tuple, tuple[list[int], list[int]]] = {}  # key -> (paying columns, instances)
    for (u, a), slots in consumers.items():
        outs = {q: [x[u[0]][a][i] for i in idx] for q, idx in problem.outputs_of(u, a).items()}
        lay = context[u]
        key = (a, problem.nbytes[u], u in problem.bucketed, problem.reduce_scale.get(u), lay[:a] + lay[a + 1:], tuple((q, tuple(c)) for q, c in outs.items()),
               tuple(tuple((p, tuple(c)) for p, c in by_pl.items()) for by_pl in slots))
        if key in systems:
            systems[key][1][0] += 1
            continue
        z: dict[tuple[Pl, Pl], int] = {}
        payers: list[int] = []
        systems[key] = (payers, [1])

        def paid(q: Pl, p: Pl) -> Optional[int]:
            """The variable paying for ``q -> p`` once for all consumers (None when free)."""
            if (q, p) not in z:
                cost = _axis_price(problem, u, a, q, p, context)
                z[(q, p)] = m.var(max(cost, MIN_COST), False) if cost > 0 else -1
                if cost > 0:
                    payers.append(z[(q, p)])
            return None if z[(q, p)] < 0 else z[(q, p)]

        for by_pl in slots:
            if len(outs) == 1 or len(by_pl) == 1:  # one side is fixed: z >= the other side's indicator
                for q, ycols in outs.items():
                    for p, wcols in by_pl.items():
                        v = paid(q, p)
                        if v is None:
                            continue
                        side = wcols if len(outs) == 1 else ycols
                        if side:
                            m.row([(v, 1.0)] + [(c, -1.0) for c in side], 0.0, 1.0)
                        else:
                            m.lb[v] = 1.0
                continue
            e = {(q, p): m.var(0.0, False) for q in outs for p in by_pl}
            for q, ycols in outs.items():
                m.row([(e[(q, p)], 1.0) for p in by_pl] + [(c, -1.0) for c in ycols], 0.0, 0.0)
            for p, wcols in by_pl.items():
                m.row([(e[(q, p)], 1.0) for q in outs] + [(c, -1.0) for c in wcols], 0.0, 0.0)
            for (q, p), ev in e.items():
                v = paid(q, p)
                if v is not None:
                    m.row([(v, 1.0), (ev, -1.0)], 0.0, 1.0)
    for payers, (count,) in systems.values():
        for v in payers:
            m.cost[v] *= count
    return m, x


def solve_problem(problem: Problem, illegal=lambda picks: [], rounds: int = 3, extend=None,
                  admissible=lambda picks: True, gap: float = 1e-6, time_limit: Optional[float] = None,
                  patient: bool = False, start: Optional[dict[str, tuple[int, ...]]] = None
                  ) -> dict[str, tuple[int, ...]]:
    """The chosen choice index per decision node and axis.

    Each MILP prices a value's change on one axis with its other axes as the previous plan laid them
    out (the greedy one first); the next round prices with the new plan's layouts. Every plan is
    scored exactly (:func:`plan_cost`) and the best, the greedy plan included, is returned; a round whose
    plan is no better than the best seen ends the search (unless ``patient``: then a plan that repeats
    the previous one does, or ``PATIENCE`` rounds in a row that lower the best cost by less than a relative
    ``STALL``; auto-sharding's budget makes later rounds find what earlier ones miss, and its rounds can
    also cycle among plans of equal cost up to the greedy tie-break). Nodes in ``problem.shared`` take their
    representative's columns (every instance's compute and edges still priced).
    ``illegal(picks)`` names nodes whose per-axis picks split a tensor illegally together (3+ axes);
    each such combination is excluded and the MILP solved again (``NoLegalPlanError`` after ``MAX_ROUNDS``
    exclusions; ``NoPlanError`` when a MILP is infeasible, e.g. under ``extend``'s rows). Logs the problem's size and the
    solve time on the ``fxshard.planner.solve`` logger (INFO). ``extend(model, x)`` adds columns and rows
    to each MILP (auto-sharding's memory budget); the greedy plan competes only if ``admissible(picks)``;
    ``gap`` is HiGHS's relative optimality gap; with ``time_limit`` (seconds per MILP) the best solution
    found by then is taken (wall-clock: ranks may differ, the caller must make them agree). ``start``
    (legal picks of every decision node, e.g. the plan auto-sharding chose its layouts with) competes
    with the greedy plan when ``admissible``, and the first round prices from it where it costs less.
    """
    try:
        import numpy as np
        if importlib.util.find_spec("scipy") is None:
            raise ImportError("No module named 'scipy'")
    except ImportError as e:
        raise ShardingError(f"planner='global' solves a MILP with HiGHS through scipy, which is not installed "
                            f"({e}); scipy is a dependency of fxshard: pip install 'scipy>=1.11' (or reinstall "
                            f"fxshard), or use planner='greedy'") from e
    milp.prestart()
    t0 = time.perf_counter()
    best = {name: nv.greedy for name, nv in problem.nodes.items()}
    greedy_cost = plan_cost(problem, best)
    best_cost = greedy_cost if admissible(best) else float("inf")
    if start is not None and admissible(start) and plan_cost(problem, start) < best_cost:
        best, best_cost = start, plan_cost(problem, start)
    prev, tried, stalled = best, 0, 0
    for _ in range(rounds if len(problem.sizes) > 1 else 1):
        m, x = _formulate(problem, layouts(problem, prev), prev)
        if extend is not None:
            extend(m, x)
        for _ in range(MAX_ROUNDS):
            res = milp.solve(*(np.asarray(v) for v in (m.cost, m.integer, m.lb, m.ub, m.rows, m.cols, m.coef,
                                                       m.row_lb, m.row_ub)),
                             options={"disp": bool(os.environ.get("FXSHARD_SOLVER_LOG")), "mip_rel_gap": gap,
                                      **({} if time_limit is None else {"time_limit": time_limit})})
            if time_limit is not None and res.x is not None and res.status == 1:
                LOG.info("MILP stopped at its time limit (%.0f s), gap %.3g", time_limit,
                         -1 if res.mip_gap is None else res.mip_gap)
            elif res.x is None or not res.success:
                raise NoPlanError(f"internal: the global planner's MILP found no plan ({res.message}); "
                                    f"use planner='greedy' and please report this model")
            picks = {name: tuple(int(np.argmax([res.x[i] for i in cols])) for cols in per_axis)
                     for name, per_axis in x.items()}
            bad = illegal(picks)
            if not bad:
                break
            for name in bad:  # exclude this combination of per-axis picks
                m.row([(x[name][a][i], 1.0) for a, i in enumerate(picks[name])], 0.0, len(picks[name]) - 1.0)
        else:
            raise NoLegalPlanError(f"internal: the global planner found no legal plan in {MAX_ROUNDS} rounds; "
                                f"use planner='greedy' and please report this model")
        tried += 1
        cost = plan_cost(problem, picks)
        improved = cost < best_cost
        stalled = 0 if math.isinf(best_cost) or cost < best_cost - STALL * abs(best_cost) else stalled + 1
        if improved:
            best, best_cost = picks, cost
        if picks == prev or (tried > 1 and not improved and not patient) or (patient and stalled >= PATIENCE):
            break
        prev = picks
    stats = {"nodes": len(x), "shared": len(problem.shared), "binaries": sum(m.integer), "variables": len(m.cost), "rows": len(m.row_lb),
             "rounds": tried, "seconds": time.perf_counter() - t0, "cost": best_cost * UNIT,
             "greedy_cost": greedy_cost * UNIT, "certified": False}
    LOG.info("global plan: %(nodes)d nodes (%(shared)d sharing a representative's variables), %(binaries)d binaries, %(variables)d variables, %(rows)d rows; "
             "%(rounds)d MILP(s) in %(seconds).2f s; cost %(cost).4g (greedy %(greedy_cost).4g)", stats,
             extra={"fxshard_solve": stats})
    return best

