"""Auto-sharding (``fxshard.shard(..., auto=True, memory_budget=...)``): completes a partial plan by cost.

Every parameter the plan does not place becomes a decision of the global planner's MILP
(``planner/solve.py``): on each mesh axis it is replicated or split on one of its dims (``S(d)``,
when the dim divides evenly). Whether a split parameter is *tensor-parallel* or *FSDP-style*
(stored split, gathered before use) is not a separate choice: it follows from what its consumers'
chosen strategies need (the split itself, or a gather priced like any other layout change), and
its gradient must arrive in the parameter's layout (a reduce-scatter instead of an all-reduce).
Parameters and buffers the plan places, and buffers, stay as given.

The memory budget is linear rows of the MILP. Per rank, for a parameter of ``n`` elements of
``b`` bytes whose layout splits it ``f`` ways: ``n*b/f`` (the parameter), plus for a trained
parameter ``n*b/f`` (its gradient) and ``2*n*b/f`` (AdamW's two states, which torch keeps in the
parameter's dtype, as ``fxshard.memory`` counts them; FSDP and tensor splits shard optimizer state like
the parameter). Per-axis choices make ``1/f`` a product, so each
parameter also gets one binary per N-D layout, tied to its per-axis binaries. Activations
(``_Activations``): every value of the planned graph (forward + backward for training, parameter
gradients included) has its local bytes as a variable bounded below by two linearizations of the
same product (exact on 1 and 2 mesh axes), and each step of the graph's liveness (``memory.liveness``,
the sweep ``fxshard.memory`` makes over each program) is a row: parameters' state + the values live
then <= budget. What this model does not see (the sharded programs' collective buffers and the
copies a redistribution makes, the transient full copy of an FSDP-style parameter, the split of
the joint graph into forward and backward programs) is then measured: ``shard()`` measures the
result with ``fxshard.memory`` (``measure``) and, when it exceeds the budget, plans again against
the budget less what the estimate missed (``next_margin``, up to ``RETRIES`` times), warning if
the last result still does not fit. A budget no plan fits even at the smallest state and
activation bounds, or for which the MILP finds no plan, is a ShardingError.

The solver's rounds change each parameter one axis at a time (each round prices a value's other axes as
the previous plan laid them out); *pair moves* then try the largest parameters in every layout that changes
two or more axes at once, pinned, with the rest planned again (``PAIR_PARAMS``, docs/solver_design.md).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.fx as fx

from . import milp
from ..comm.consistency import on_lead
from ..tracing.joint import CollectiveGradient, joint_context, trace_joint
from .propagate import propagate
from ..tracing.export import Traced
from ..core.context import ShardContext
from ..core.errors import NoLegalPlanError, NoPlanError, ShardingError
from ..core.ir import META_KEY
from ..analysis.liveness import OPTIMIZER_STATES, liveness, liveness_peak_of
from ..core.placements import Pl, R, S
from ..core.sizes import fmt_bytes as _fmt, parse_bytes
from ..core.spec import Spec
from .formulate import UNIT, layouts, plan_cost, solve_problem
from .problem import build_problem

__all__ = ["parse_budget", "AutoChoice", "AutoReport", "complete_plan", "choose_placements", "solve_within", "measure",
           "next_margin", "state_bytes"]

# the budget makes the MILP a knapsack: proving the last percent costs minutes, and the chosen layouts are
# planned again (planner="global", the parameters fixed) when the model is sharded
GAP = 0.001  # relative to the objective, which includes the (large) compute term: 1% let through 2x the comm
TIME_LIMIT = 60.0  # seconds; then the best plan found is taken, rank 0's on every rank
ROUNDS = 6  # MILPs, each pricing a value's other mesh axes as the previous plan laid them out (solve.py); 3 left
# the 8B MLP replicated (2.29x the hand plan's bytes), the 4th round finds Megatron (1.00x)
PAIR_PARAMS = 2  # the largest free parameters tried in layouts that change two or more axes at once
PAIR_ROUNDS = 2
PAIR_TIME_LIMIT = 10.0  # seconds per MILP of a pinned trial (it only has to beat the plan in hand)
SMALL = 1.0 / 4096  # values under this share of the budget count at their data-parallel size (no MILP column)
RETRIES = 2  # plans again, with the budget tightened by the measured excess, when the result does not fit


def parse_budget(budget: Union[int, float, str, None]) -> Optional[int]:
    """Bytes per rank from ``budget``: a number of bytes, or a string like ``"8GiB"``, ``"512 MiB"``,
    ``"1.5GB"`` (None: no budget). Anything else is a ShardingError."""
    return parse_bytes(budget, "memory_budget")


@dataclass(frozen=True)
class AutoChoice:
    """One plan entry the solver chose: the parameter, its layout (one placement per mesh axis), the
    bytes per rank it saves against replicating it (parameter, gradient, optimizer state), and the
    communication its layout adds (negative: saves) against storing it replicated with every op's
    strategy unchanged, in the solver's byte-equivalents."""

    fqn: str
    placements: tuple[Pl, ...]
    memory_saved: int
    comm_delta: float


@dataclass(frozen=True)
class AutoReport:
    """What ``auto=True`` decided: the chosen entries (replicated ones left out), the per-rank memory
    estimate and budget, the solver's communication estimate of the plan and of the data-parallel
    plan (every free parameter replicated), and the solve time."""

    chosen: tuple[AutoChoice, ...]
    replicated: tuple[str, ...]
    footprint: int
    budget: Optional[int]
    activation_peak: int
    comm: float
    comm_replicated: float
    seconds: float
    measured: Optional[int] = None  # the sharded result's footprint (fxshard.memory, AdamW), once known
    margin: int = 0  # planned against budget - margin: what earlier plans' estimates missed (``next_margin``)
    # every decision node's chosen strategy per axis, (input placements, output placements): the plan the
    # placements were chosen with, which the global planner re-planning the chosen layouts starts from
    # (``solve_within``'s ``hint``)
    strategies: Optional[dict] = field(default=None, repr=False, compare=False)

    def lines(self) -> list[str]:
        budget = "no budget" if self.budget is None else f"budget {_fmt(self.budget)}"
        out = [f"auto plan: {len(self.chosen)} entries chosen by the solver, {len(self.replicated)} parameters left "
               f"replicated; memory per rank {_fmt(self.footprint)} ({budget}; activation peak estimate "
               f"{_fmt(self.activation_peak)}); comm estimate {_fmt(self.comm)} vs {_fmt(self.comm_replicated)} "
               f"with every free parameter replicated; solved in {self.seconds:.1f} s"]
        if self.margin:
            out.append(f"  planned against {_fmt(self.budget - self.margin)}: an earlier plan's estimate was "
                       f"{_fmt(self.margin)} under its measured footprint")
        if self.measured is not None:
            out.append(f"  measured on the sharded result (fxshard.memory, AdamW, the larger program peak): "
                       f"{_fmt(self.measured)} per rank")
        for c in self.chosen:
            delta = f"adds {_fmt(c.comm_delta)}" if c.comm_delta >= 0 else f"saves {_fmt(-c.comm_delta)}"
            out.append(f"  {c.fqn}: {c.placements}  saves {_fmt(c.memory_saved)} per rank; {delta} of communication")
        return out


def _split(layout: tuple[Pl, ...], sizes: tuple[int, ...]) -> int:
    f = 1
    for p, n in zip(layout, sizes):
        if isinstance(p, S):
            f *= n
    return f


def _legal(shape: tuple[int, ...], layout: tuple[Pl, ...], sizes: tuple[int, ...]) -> bool:
    """Whether auto may give a parameter ``layout``: every split dim divides, and no dim is split on two mesh
    axes (a search-space choice: each parameter's options stay one per axis; a hand plan may ask for
    such layouts)."""
    for d, size in enumerate(shape):
        f, axes = 1, 0
        for p, n in zip(layout, sizes):
            if isinstance(p, S) and p.dim == d:
                f *= n
                axes += n > 1
        if size % f or axes > 1:
            return False
    return True


def state_bytes(val: torch.Tensor, layout: tuple[Pl, ...], sizes: tuple[int, ...], trained: bool) -> int:
    """Per-rank bytes of a parameter in ``layout``: itself, and when ``trained`` its gradient and AdamW's
    states (``OPTIMIZER_STATES["adamw"]`` tensors in the parameter's dtype; module doc)."""
    per = val.dtype.itemsize * (1 + (1 + OPTIMIZER_STATES["adamw"] if trained else 0))
    return val.numel() * per // _split(layout, sizes)


class _Activations:
    """The activation memory of a plan of the joint graph ``gm``: the liveness peak of its values at their
    local sizes under the plan's layouts (``memory.liveness``, as ``fxshard.memory`` sums each program),
    parameter gradients included (the backward program allocates them; ``fxshard.memory``'s backward
    peak counts them), and the same peak as MILP rows.

    A value ``u`` of ``N`` global bytes split on the axes ``a`` where ``s_a = 1`` has ``N * prod_a g_a``
    local bytes, ``g_a = 1 - (1 - 1/n_a) s_a``: a product of binaries. Its variable ``w_u`` is bounded below
    by the linearizations at "no axis splits" and "every axis splits" (``w >= N (1 - sum_a (1 - 1/n_a)
    s_a)`` and ``w >= N L (1 + sum_a (n_a - 1)(1 - s_a))``, ``L = prod 1/n_a``); both are below the product
    at every 0/1 point (it is supermodular), and on 1 and 2 axes their maximum equals it, so the budget
    rows, which push ``w`` down, count exactly what the plan allocates (3+ axes: a lower bound). One row
    per step where a value dies (a step where none dies is covered by the next): the values live then,
    plus the parameters' state, within the budget; steps that cannot bind (their values at their largest
    under another step's values at their smallest, or a subset of another step's values) are left out."""

    def __init__(self, gm: fx.GraphModule, problem, sizes: tuple[int, ...]):
        self.values, self.frees = liveness(gm)
        self.problem, self.sizes = problem, sizes
        self.keys = {}
        for n in self.values:
            spec = n.meta.get(META_KEY)
            self.keys[n] = [(n.name, j) for j, s in enumerate(spec if isinstance(spec, tuple) else (spec,))
                            if isinstance(s, Spec) and (n.name, j) in problem.nbytes]
        steps = []  # (live keys, their least bytes, their most bytes) where some value dies
        live: dict = {}
        for t, n in enumerate(self.values):
            for key in self.keys[n]:
                live[key] = True
            dying = self.frees.get(t, ())
            if dying or t == len(self.values) - 1:
                keys = frozenset(live)
                steps.append((keys, sum(self._least(k) for k in keys), sum(self._most(k) for k in keys)))
            for d in dying:
                for key in self.keys[d]:
                    live.pop(key, None)
        # a step whose values cannot outweigh another step's least, or whose values another step holds too,
        # never binds
        floor = max((lo for _, lo, _ in steps), default=0.0)
        steps = sorted((st for st in steps if st[2] >= floor), key=lambda st: -len(st[0]))
        self.steps: list[frozenset] = []
        for keys, _, _ in steps:
            if not any(keys <= other for other in self.steps):
                self.steps.append(keys)

    def local(self, key, lay: tuple[Pl, ...]) -> float:
        return self.problem.nbytes[key] / _split(lay, self.sizes)

    def peak(self, lays: dict) -> int:
        """The liveness peak with every value laid out as ``lays`` (value key -> layout) says."""
        return int(liveness_peak_of(self.values, self.frees, lambda n: sum(self.local(k, lays[k]) for k in self.keys[n])))

    def smallest(self) -> int:
        """A lower bound over all plans: each value split on every axis some choice of its producer splits it."""
        return int(liveness_peak_of(self.values, self.frees, lambda n: sum(self._least(k) for k in self.keys[n])))

    def rows(self, m, x, state: int, scale: float, room: float, small: float) -> None:
        """Adds to MILP ``m`` (choice columns ``x``) a row per step of ``self.steps``: ``state`` (the column
        of the parameters' bytes times ``scale``) plus the live values' bytes times ``scale``, at most
        ``room``. Values under ``small`` bytes at their greedy layout count at it, as constants."""
        problem, sizes = self.problem, self.sizes
        L = 1.0
        for n in sizes:
            L /= n
        col: dict = {}
        const: dict = {}
        for n in self.values:
            for key in self.keys[n]:
                nv = problem.nodes.get(key[0])
                greedy = self.local(key, problem.fixed.get(key, problem.greedy[key]))
                if nv is None or greedy < small:
                    const[key] = greedy
                    continue
                N = problem.nbytes[key] * scale
                w = m.var(0.0, False, 0.0, float("inf"))
                split = [(a, x[key[0]][a][i]) for a in range(len(sizes)) for i, c in enumerate(nv.axes[a])
                         if isinstance(c.outputs[key[1]], S)]  # s_a: the producer's choices splitting it on a
                m.row([(w, 1.0)] + [(v, N * (1 - 1 / sizes[a])) for a, v in split], N, float("inf"))
                m.row([(w, 1.0)] + [(v, N * L * (sizes[a] - 1)) for a, v in split],
                      N * L * (1 + sum(n - 1 for n in sizes)), float("inf"))
                col[key] = w
        for keys in self.steps:
            terms = [(state, 1.0)] + [(col[k], 1.0) for k in keys if k in col]
            m.row(terms, -float("inf"), room - scale * sum(const[k] for k in keys if k in const))

    def _least(self, key) -> float:
        return self._bound(key, any)

    def _most(self, key) -> float:
        return self._bound(key, all)

    def _bound(self, key, split_if) -> float:
        """Local bytes of value ``key`` split on each axis where ``split_if`` (any/all) of its producer's
        choices split it: the smallest (``any``) or largest (``all``) it can be; a fixed value's own."""
        nv = self.problem.nodes.get(key[0])
        if nv is None:
            return self.local(key, self.problem.fixed.get(key, self.problem.greedy[key]))
        return self.local(key, tuple(S(0) if split_if(isinstance(c.outputs[key[1]], S) for c in axis) else R
                                     for axis in nv.axes))


def choose_placements(gm: fx.GraphModule, ctx: ShardContext, free: dict[str, list[str]], tied: dict[int, str],
                      trained: set[str], fixed_bytes: int, budget: Optional[int], margin: int = 0
                      ) -> tuple[dict[str, tuple[Pl, ...]], AutoReport]:
    """Layouts for the ``free`` placeholders of a propagated graph (placeholder name -> the FQNs it
    feeds) within ``budget`` bytes per rank, planned against ``budget - margin``.

    Requires: ``gm`` propagated with every free placeholder replicated; ``tied`` maps output indices to
    the free placeholder whose layout they take (gradients); ``trained`` names the free placeholders
    that get gradients; ``fixed_bytes`` the per-rank bytes of everything placed by the user.
    Ensures: FQN -> layout for every free parameter, the same on every rank (rank 0's), whose
    footprint (state + the activation peak of ``_Activations``) fits ``budget - margin``; a ShardingError
    with the smallest footprint otherwise."""
    t0 = time.perf_counter()
    search = _LayoutSearch(gm, ctx, free, tied, trained, fixed_bytes, budget, margin)
    if search.room is not None and search.least_state + search.least_act > search.room:
        raise search.no_fit("")
    picks = on_lead(search.plan, ctx.mesh, "auto-sharding's solve")
    return search.result(picks, t0)


class _LayoutSearch:
    """``choose_placements``'s search: the global planner's problem with every free placeholder a decision
    (``options``: its legal layouts, ``cost``: each one's per-rank state bytes), the activation model
    (``acts``) and the budget rows that keep state + activations within ``room`` (None: no budget).
    Requires what ``choose_placements`` requires; ``plan`` runs the solver, ``result`` reports its picks."""

    def __init__(self, gm: fx.GraphModule, ctx: ShardContext, free: dict[str, list[str]], tied: dict[int, str],
                 trained: set[str], fixed_bytes: int, budget: Optional[int], margin: int):
        self.sizes = sizes = tuple(ctx.mesh.sizes)
        self.free, self.budget, self.margin, self.fixed_bytes = free, budget, margin, fixed_bytes
        self.room = None if budget is None else budget - margin
        vals = {n.name: n.meta["val"] for n in gm.graph.nodes if n.name in free}
        cands = {name: [[R] + [S(d) for d, s in enumerate(v.shape) if s % n == 0 and n > 1] for n in sizes]
                 for name, v in vals.items()}
        self.options = {name: [lay for lay in itertools.product(*cands[name]) if _legal(tuple(v.shape), lay, sizes)]
                        for name, v in vals.items()}
        self.cost = {name: [state_bytes(vals[name], lay, sizes, name in trained) for lay in lays]
                     for name, lays in self.options.items()}
        self.problem = build_problem(gm, ctx, free=cands, tied=tied)
        self.acts = _Activations(gm, self.problem, sizes)
        self.least_state = fixed_bytes + sum(min(c) for c in self.cost.values())
        self.least_act = self.acts.smallest()

    def no_fit(self, why: str) -> ShardingError:
        """The error for a budget no plan fits (``why``: how the solver failed, or empty), with the smallest
        footprint any plan has."""
        budget, room, margin = self.budget, self.room, self.margin
        least_state, least_act, fixed_bytes = self.least_state, self.least_act, self.fixed_bytes
        tightened = f", planned against {_fmt(room)} to leave {_fmt(margin)} for what the estimate misses" if margin else ""
        return ShardingError(
            f"memory_budget={_fmt(budget)} per rank: no plan fits{why}; the smallest footprint is at least "
            f"{_fmt(least_state + least_act)} (parameters, gradients and AdamW state with every free parameter "
            f"split as far as the mesh allows {_fmt(least_state - fixed_bytes)}, parameters placed by the plan and "
            f"buffers {_fmt(fixed_bytes)}, activations with every value split as far as its op allows "
            f"{_fmt(least_act)}){tightened}; raise memory_budget, use a larger mesh, split the activations "
            f"(in_specs) or leave fewer parameters placed by hand")

    def plan(self) -> dict[str, tuple[int, ...]]:
        """The chosen picks: the solver's rounds, then (2+ mesh axes) the pair moves; ``no_fit`` when the
        solver finds no plan within the budget."""
        try:
            picks = solve_problem(self.problem, rounds=ROUNDS, extend=None if self.room is None else self.extend,
                                  gap=GAP, time_limit=TIME_LIMIT, patient=True, admissible=self.admissible)
            return self.pair_moves(picks) if len(self.sizes) > 1 else picks
        except NoPlanError as e:
            if self.room is None:
                raise
            raise self.no_fit(f" (the solver found none within {TIME_LIMIT:.0f} s or proved there is none)") from e

    def layout(self, name: str, picks: dict) -> tuple[Pl, ...]:
        """Free placeholder ``name``'s layout under ``picks``."""
        return tuple(self.problem.nodes[name].axes[a][i].outputs[0] for a, i in enumerate(picks[name]))

    def state(self, picks: dict) -> int:
        """Per-rank bytes of every parameter's state (itself, gradient, AdamW states) under ``picks``."""
        return self.fixed_bytes + sum(self.cost[name][self.options[name].index(self.layout(name, picks))]
                                      for name in self.free)

    def admissible(self, picks: dict) -> bool:
        """Whether ``picks`` fits the room (state + the activation peak), or there is no budget."""
        return self.room is None or self.state(picks) + self.acts.peak(layouts(self.problem, picks)) <= self.room

    def extend(self, m, x) -> None:
        """Adds the budget to MILP ``m`` (choice columns ``x``): per free parameter one binary per N-D layout,
        tied to its per-axis binaries; their state bytes summed into one column; the activation rows."""
        problem, fixed_bytes, scale = self.problem, self.fixed_bytes, 1.0 / self.room
        total = m.var(0.0, False, 0.0, float("inf"))
        terms = [(total, -1.0)]
        for name, lays in self.options.items():
            y = [m.var(0.0, True) for _ in lays]
            for a in range(len(self.sizes)):
                for i, c in enumerate(problem.nodes[name].axes[a]):
                    m.row([(x[name][a][i], -1.0)] + [(y[j], 1.0) for j, lay in enumerate(lays)
                                                     if lay[a] == c.outputs[0]], 0.0, 0.0)
            terms += [(y[j], self.cost[name][j] * scale) for j in range(len(lays))]
        m.row(terms, -fixed_bytes * scale, -fixed_bytes * scale)  # total = every parameter's state, scaled
        self.acts.rows(m, x, total, scale, 1.0, self.room * SMALL)

    def pinned(self, name: str, lay: tuple[Pl, ...]):
        """An ``extend`` for ``solve_problem`` that adds the budget and pins ``name`` to ``lay``."""
        def ext(m, x) -> None:
            if self.room is not None:
                self.extend(m, x)
            for a, p in enumerate(lay):
                m.row([(x[name][a][i], 1.0) for i, c in enumerate(self.problem.nodes[name].axes[a])
                       if c.outputs[0] == p], 1.0, 1.0)
        return ext

    def pair_moves(self, picks: dict) -> dict:
        """The rounds change a parameter one axis at a time, each priced with the other axes as the previous
        plan laid them out, so a move that pays only when two axes change together (an embedding from
        hidden-split over dp to vocab-split over tp) is never taken. For the largest parameters, each
        layout differing from the rounds' on two or more axes is pinned and the rest planned again (the
        trials are independent: they run at once, one solver process each, up to the CPUs this process
        may use); the cheapest plan (exactly, ``plan_cost``; the first in trial order among equals) that
        costs less than the rounds' and fits is kept."""
        options, cost = self.options, self.cost
        trials = [(name, lay) for name in sorted(options, key=lambda n: -max(cost[n]))[:PAIR_PARAMS]
                  for lay in options[name] if sum(p != q for p, q in zip(lay, self.layout(name, picks))) >= 2]
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        workers = max(1, min(len(trials), cpus))  # sched_getaffinity: Linux only
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fxshard-pair-move") as pool:
            planned = list(pool.map(self.trial, trials))
        milp.trim(1)  # the trials' extra solver processes: not kept for the rest of the run
        best = plan_cost(self.problem, picks)
        for p in planned:
            if p is None:
                continue
            c = plan_cost(self.problem, p)
            if c < best and self.admissible(p):
                picks, best = p, c
        return picks

    def trial(self, t: tuple) -> Optional[dict]:
        """A pair move's plan with free placeholder ``t[0]`` pinned to layout ``t[1]``; None when nothing fits
        with this layout (an error of the solver itself, e.g. its process crashing twice, is raised)."""
        try:
            return solve_problem(self.problem, rounds=PAIR_ROUNDS, extend=self.pinned(*t), gap=GAP,
                                 time_limit=PAIR_TIME_LIMIT, patient=True, admissible=lambda p: False)
        except (NoPlanError, NoLegalPlanError):  # nothing fits with this layout
            return None

    def result(self, picks: dict, t0: float) -> tuple[dict[str, tuple[Pl, ...]], AutoReport]:
        """FQN -> layout for every free parameter under ``picks``, and the report (solve started at ``t0``)."""
        problem, sizes, cost, options, free = self.problem, self.sizes, self.cost, self.options, self.free
        chosen = {name: self.layout(name, picks) for name in free}
        total = plan_cost(problem, picks)
        act = self.acts.peak(layouts(problem, picks))
        entries, replicated = [], []
        for name, lay in chosen.items():
            if all(p == R for p in lay):
                replicated += free[name]
                continue
            flipped = dict(picks)
            flipped[name] = tuple(next(i for i, c in enumerate(axis) if c.outputs[0] == R)
                                  for axis in problem.nodes[name].axes)
            saved = cost[name][options[name].index((R,) * len(sizes))] - cost[name][options[name].index(lay)]
            delta = (total - plan_cost(problem, flipped)) * UNIT
            entries += [AutoChoice(fqn, lay, saved, delta) for fqn in free[name]]
        greedy = {name: nv.greedy for name, nv in problem.nodes.items()}
        strategies = {name: tuple((nv.axes[a][i].inputs, nv.axes[a][i].outputs) for a, i in enumerate(picks[name]))
                      for name, nv in problem.nodes.items() if name not in free}
        report = AutoReport(tuple(entries), tuple(replicated), self.state(picks) + act, self.budget, act,
                            total * UNIT, plan_cost(problem, greedy) * UNIT, time.perf_counter() - t0,
                            margin=self.margin, strategies=strategies)
        return {fqn: lay for name, lay in chosen.items() for fqn in free[name]}, report


def solve_within(gm: fx.GraphModule, ctx: ShardContext, problem, illegal, hint: Optional[dict] = None
                 ) -> dict[str, tuple[int, ...]]:
    """The global planner's picks for ``problem`` (a graph whose parameters auto-sharding placed) with the
    liveness peak of its values within ``ctx.activation_room`` bytes (the ``_Activations`` rows), rank
    0's on every rank. Without these rows the planner re-plans the chosen parameter layouts for
    communication alone and may lay the activations out larger than the auto plan counted. When no plan
    keeps the peak within the room (or none is found in time), the plan without the rows: the result
    is measured afterwards (``measure``).

    ``hint`` (``AutoReport.strategies``): the strategies auto-sharding chose the layouts with. Its rounds
    and pair moves reach plans that the planner's rounds, started from the greedy plan, do not (a change
    that pays only on two axes at once); where every node of ``problem`` offers the hinted strategy, that
    plan competes with the greedy one and the rounds start from it, so the program is never planned worse
    than the plan the layouts were chosen for."""
    room = ctx.activation_room
    acts = _Activations(gm, problem, tuple(ctx.mesh.sizes))
    start = _hinted_picks(problem, hint, illegal)

    def extend(m, x) -> None:
        acts.rows(m, x, m.var(0.0, False, 0.0, 0.0), 1.0 / max(room, 1), 1.0, max(room, 1) * SMALL)

    def plan() -> dict[str, tuple[int, ...]]:
        try:
            return solve_problem(problem, illegal, extend=extend, gap=GAP, time_limit=TIME_LIMIT,
                                 admissible=lambda p: acts.peak(layouts(problem, p)) <= room, start=start)
        except NoPlanError:
            return solve_problem(problem, illegal, gap=GAP, time_limit=TIME_LIMIT)

    return on_lead(plan, ctx.mesh, "the global planner within auto-sharding's budget")


def _hinted_picks(problem, hint: Optional[dict], illegal) -> Optional[dict[str, tuple[int, ...]]]:
    """``hint``'s strategies as choice indices of ``problem``; None when there is no hint, some decision node
    has no hinted strategy among its choices, or the picks split a tensor illegally (``illegal``)."""
    if not hint:
        return None
    picks = {}
    for name, nv in problem.nodes.items():
        want = hint.get(name)
        if want is None or len(want) != len(nv.axes):
            return None
        idx = []
        for axis, (ins, outs) in zip(nv.axes, want):
            i = next((i for i, c in enumerate(axis) if c.inputs == ins and c.outputs == outs), None)
            if i is None:
                return None
            idx.append(i)
        picks[name] = tuple(idx)
    return None if illegal(picks) else picks


def complete_plan(traced: Traced, ctx: ShardContext, param_pls: dict[str, tuple[Pl, ...]], wants_grad: list[bool],
                  budget: Optional[int], margin: int = 0, bucket_mb: Optional[float] = None
                  ) -> tuple[dict[str, tuple[Pl, ...]], Optional[AutoReport]]:
    """``param_pls`` (the user's plan, resolved) completed with a layout for every parameter it leaves
    out, and the report (None when nothing was left out). Requires ``ctx`` annotated from
    ``param_pls`` (free parameters replicated); plans the training graph when any placeholder
    ``wants_grad``, else the forward, within ``budget - margin``, its gradients priced as the bucket pass
    will send them (``bucket_mb``, as ``shard``'s). The traced forward is left as it was."""
    sizes = tuple(ctx.mesh.sizes)
    fwd_ph = [n for n in traced.gm.graph.nodes if n.op == "placeholder"]
    free = {node.name: list(slot.names) for node, slot in zip(fwd_ph, traced.slots)
            if slot.kind == "param" and isinstance(node.meta.get("val"), torch.Tensor)
            and not any(n in param_pls for n in slot.names)}
    if not free:
        return param_pls, None
    joint = None
    if any(wants_grad):
        try:
            joint = trace_joint(traced, traced.gm, wants_grad)
        except CollectiveGradient:  # no training program (shard() records why): the forward is all that runs
            wants_grad = [False] * len(wants_grad)
    fixed = sum(state_bytes(node.meta["val"], ctx.seeds[node], sizes, slot.kind == "param" and w)
                for node, slot, w in zip(fwd_ph, traced.slots, wants_grad)
                if slot.kind in ("param", "buffer") and isinstance(node.meta.get("val"), torch.Tensor)
                and node.name not in free)
    trained = {node.name for node, w in zip(fwd_ph, wants_grad) if w and node.name in free}
    if joint is not None:
        gm, pctx = joint.gm, joint_context(traced, ctx, joint, bucket_mb)
        joint_ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
        rename = {f.name: j.name for f, j in zip(fwd_ph, joint_ph)}
        tied = {len(ctx.out_required) + m: rename[fwd_ph[i].name] for m, i in enumerate(joint.diff_in)
                if fwd_ph[i].name in free}
    else:
        gm, tied = copy.deepcopy(traced.gm), {}
        copy_ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
        rename = {f.name: c.name for f, c in zip(fwd_ph, copy_ph)}
        pctx = ShardContext(mesh=ctx.mesh, label=ctx.label, seeds={c: ctx.seeds[f] for f, c in zip(fwd_ph, copy_ph)
                                                                  if f in ctx.seeds},
                            out_required=list(ctx.out_required), constraints=dict(ctx.constraints))
    propagate(gm, pctx)
    chosen, report = choose_placements(gm, pctx, {rename[k]: v for k, v in free.items()}, tied,
                                       {rename[k] for k in trained}, fixed, budget, margin)
    return {**param_pls, **chosen}, report


def measure(report: AutoReport, mem: dict[str, int], last: bool = True) -> AutoReport:
    """``report`` with the footprint ``fxshard.memory(sm, "adamw")`` gives for the result (state plus the
    largest program peak); when ``last`` (no more plans will be tried) warns if that exceeds the budget."""
    peak = max(v for k, v in mem.items() if k.endswith("_peak"))
    measured = mem["params"] + mem["buffers"] + mem["grads"] + mem["optimizer"] + peak
    if last and report.budget is not None and measured > report.budget:
        warnings.warn(f"fxshard auto: the sharded model needs {_fmt(measured)} per rank by fxshard.memory (its "
                      f"activation peak {_fmt(peak)}, estimated {_fmt(report.activation_peak)} when planning"
                      f"{f' against {_fmt(report.budget - report.margin)}' if report.margin else ''}), over "
                      f"memory_budget={_fmt(report.budget)}, after {RETRIES + 1} plans; lower the budget by the "
                      f"difference to leave room, or split the activations (in_specs)", stacklevel=3)
    return dataclasses.replace(report, measured=measured)


def next_margin(report: AutoReport) -> Optional[int]:
    """None when the measured ``report`` fits its budget (or has none); else the margin to plan the next
    attempt with: what this plan's estimate missed (measured - estimated footprint), and at least the
    margin so far plus the excess, so that the planned-for budget shrinks every attempt."""
    if report.budget is None or report.measured is None or report.measured <= report.budget:
        return None
    return max(report.measured - report.footprint, report.margin + report.measured - report.budget)
