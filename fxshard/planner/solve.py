"""Pass 3b, solve: the global planner. One MILP chooses every op's strategy for the whole graph.

Requires: a propagated graph (``META_KEY``, ``IN_KEY``, ``STRATEGY_KEY`` from the greedy sweep, which
seeds the candidates, prices the other mesh axes and breaks ties) and ``ctx.planner``. Does nothing
unless ``ctx.planner == "global"``.
Ensures: the same meta, now holding the strategies that minimise the priced redistribution cost of
the whole graph plus the compute its contractions repeat, a layout change several consumers need
priced once (as the redistribute pass emits it). Seeds (parameters, inputs), constraints
(``fxshard.constrain``, ParallelStyle boundaries) and required outputs are fixed: data of the
problem, never variables. Among plans of equal cost the greedy one is kept.

The choice problem is ``planner/problem.py``, its MILP ``planner/formulate.py`` (module doc: the
formulation), the certificate that skips it ``planner/certificate.py``, writing the plan back
``planner/apply.py``.
"""

from __future__ import annotations

import hashlib
import os
import time

import torch.fx as fx

from ..comm.consistency import check_same_on_all_ranks, on_lead
from ..core.context import ShardContext
from .apply import apply
from .certificate import greedy_is_optimal
from .formulate import LOG, UNIT, plan_cost, solve_problem
from .problem import Problem, build_problem, cluster, legality

__all__ = ["solve", "PLANNERS"]

PLANNERS = ("greedy", "global")


def solve(gm: fx.GraphModule, ctx: ShardContext) -> fx.GraphModule:
    """The pipeline stage (module doc): ``gm`` re-planned in place when ``ctx.planner == "global"``."""
    if ctx.planner != "global":
        return gm
    problem = build_problem(gm, ctx)
    if ctx.activation_room is not None:  # auto-sharding's memory budget (fxshard/planner/auto.py); its rows index
        # every node's own columns, so its problem is not clustered
        picks = ctx.solve_within(gm, ctx, problem, legality(gm, problem))
    else:
        # one rank plans (the others would repeat the same MILP on the same CPUs; and with uneven splits
        # each rank prices its own local pieces, so ranks could even decide differently)
        picks = on_lead(lambda: _plan(gm, problem), ctx.mesh, "the global planner")
        check_same_on_all_ranks({"global plan": hashlib.sha256(repr(sorted(picks.items())).encode()).hexdigest()},
                                ctx.mesh)
    apply(gm, ctx, problem, picks)
    return gm


def _plan(gm: fx.GraphModule, problem: Problem) -> dict[str, tuple[int, ...]]:
    """The greedy plan when ``greedy_is_optimal`` proves it, else the MILP's (identical layers clustered)."""
    t0 = time.perf_counter()
    if greedy_is_optimal(problem):  # what solve_problem would return, without importing scipy or a MILP
        picks = {name: nv.greedy for name, nv in problem.nodes.items()}
        cost = plan_cost(problem, picks) * UNIT
        stats = {"nodes": len(picks), "binaries": 0, "variables": 0, "rows": 0, "rounds": 0,
                 "seconds": time.perf_counter() - t0, "cost": cost, "greedy_cost": cost, "certified": True}
        LOG.info("global plan: %(nodes)d nodes, the greedy plan is provably optimal (no MILP, %(seconds).2f s); "
                 "cost %(cost).4g", stats, extra={"fxshard_solve": stats})
        return picks
    if os.environ.get("FXSHARD_CLUSTER", "1") != "0":
        problem.shared = cluster(gm, problem)
    return solve_problem(problem, legality(gm, problem))
