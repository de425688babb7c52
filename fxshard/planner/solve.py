"""Pass 3b, solve: the global planner. One MILP chooses every op's strategy for the whole graph.

Requires: a propagated graph (``META_KEY``, ``IN_KEY``, ``STRATEGY_KEY`` from the greedy sweep, which
seeds the candidates, prices the other mesh axes and breaks ties) and ``ctx.planner``. Does nothing
unless ``ctx.planner == "global"``.
Ensures: the same meta, now holding the strategies that minimise the priced redistribution cost of
the whole graph plus the compute its contractions repeat, a layout change several consumers need
priced once (as the redistribute pass emits it). Seeds (parameters, inputs), constraints
(``fxshard.constrain``, ParallelStyle boundaries) and required outputs are fixed: data of the
problem, never variables. Among plans of equal cost the greedy one is kept.

The formulation (docs/solver_design.md): per node and mesh axis, a binary per strategy its rule
admits, exactly one chosen; pairs of per-axis strategies that split a dim illegally together
exclude each other. Per value, axis and consumer, the producer's output placement ``q`` and the
consumer's required placement ``p`` are coupled by ``e[q, p]`` with both marginals (the local
polytope, tight on chains and trees); ``z[q, p] >= e[q, p]`` over all consumers of the value pays
``price(q -> p)`` once. HiGHS solves it through ``scipy.optimize.milp``, in a child process (``fxshard.planner.milp``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import logging
import math
import operator
import os
import time
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.fx as fx

from . import milp
from .clusters import node_classes
from ..comm.consistency import check_same_on_all_ranks, on_lead
from ..plans.constrain import CONSTRAIN_OP
from ..core.context import ShardContext
from .cost import UNIFORM, Link, transition_cost
from ..comm.transition import reduce_scale
from ..core.errors import ShardingError
from ..core.placements import Part, Pl, R, S
from ..rules.registry import (OpCall, Strategy, allows_uneven, lookup, out_shape_of, replicate_all,
                        strategy_specs, strategy_valid, tensor_inputs, tensor_output_leaves)
from ..rules.attention import WORK as ATTENTION_WORK, flops as attention_flops
from ..rules.matmul import ADD_EINSUMS, EINSUMS
from ..core.spec import Spec
from ..core.ir import FALLBACK_KEY, IN_KEY, META_KEY, STRATEGY_KEY
from ..core.torch_compat import optimization_hint

__all__ = ["solve", "price", "build_problem", "solve_problem", "greedy_is_optimal", "Problem", "PLANNERS"]

PLANNERS = ("greedy", "global")
LOG = logging.getLogger("fxshard.planner.solve")
Layout = tuple[Pl, ...]  # one placement per mesh axis
ValueKey = tuple[str, int]  # (producing node's name, output index; 0 for single-output nodes)
UNIT = float(2 ** 20)  # objective in MiB-equivalents: keeps HiGHS's tolerances meaningful
TIE = 1.0 / UNIT  # one byte-equivalent off per greedy choice: equal-cost plans keep it, no real saving is lost
MIN_COST = 1e-6  # a priced step costs at least ~1 byte-equivalent (HiGHS ignores smaller costs)
FLOPS_PER_BYTE = 1000.0  # compute priced against communication: flops a device does while its link moves a byte
MAX_ROUNDS = 20  # re-solves that exclude a combination of per-axis choices found illegal (3+ axes)
PATIENCE = 2  # patient rounds in a row without a real improvement (STALL) that end the search
STALL = 1e-6  # relative: less is the greedy tie-break's order of magnitude, not a better plan
MAX_COMBOS = 4096  # N-D choices of one node the optimality certificate enumerates (beyond: not certified)
ROUNDING = 1e-9  # relative slack of the certificate's comparison (float sums in a different order)


def price(src: Layout, dst: Layout, nbytes: float, sizes: tuple[int, ...], links: tuple[Link, ...] = ()) -> float:
    """Cost of redistributing a tensor of ``nbytes`` global bytes from layout ``src`` to ``dst`` on a mesh
    of ``sizes`` whose axes are joined by ``links`` (empty: all alike): the solver's only pricing call.

    Axes change innermost first, as the collectives are emitted; each step is priced by
    ``cost.transition_cost`` on the bytes the tensor has on that axis (divided by the other axes' splits),
    a reduce_scatter by the bytes it sends (``rs_policy=False``: the greedy sweep's price of an all_reduce
    made the solver undo a user's sequence split; see ``cost.py``)."""
    if src == dst:
        return 0.0
    cur = list(src)
    cost = 0.0
    # the bucket pass packs a gradient's last collective only, and axes change innermost first
    last_reduction = min((a for a in range(len(cur)) if isinstance(cur[a], Part) and cur[a] != dst[a] and sizes[a] > 1),
                         default=None)
    for a in reversed(range(len(cur))):
        if cur[a] == dst[a] or sizes[a] == 1:
            continue
        others = 1
        for b, p in enumerate(cur):
            if b != a and isinstance(p, S):
                others *= sizes[b]
        link = links[a] if links else UNIFORM
        if link.bucket is not None and a != last_reduction:
            link = replace(link, bucket=None)
        cost += transition_cost(cur[a], dst[a], nbytes / others, sizes[a], link, rs_policy=False)
        cur[a] = dst[a]
    return cost


def links_of(problem: "Problem", u: ValueKey) -> tuple[Link, ...]:
    """The links value ``u``'s layout changes are priced on: ``problem.links``, with the bucket size for a
    gradient the bucket pass packs (``price`` applies it to the last reduction only), and the factor its
    Partial sums' reductions widen its bytes by (``problem.reduce_scale``, ``Link.reduce_scale``)."""
    base = problem.bucket_links if u in problem.bucketed else problem.links
    scale = problem.reduce_scale.get(u)
    if scale is None:
        return base
    key = (u in problem.bucketed, scale)
    if key not in problem.scaled_links:
        problem.scaled_links[key] = tuple(replace(link, reduce_scale=scale)
                                          for link in (base or (UNIFORM,) * len(problem.sizes)))
    return problem.scaled_links[key]


def _nbytes(val: torch.Tensor) -> float:
    """Bytes of ``val``, symbolic sizes counted by their hint (64 without one), as propagate does."""
    n = 1
    for s in val.shape:
        n *= optimization_hint(s, fallback=64)
    return float(n * val.dtype.itemsize)


@dataclass(frozen=True)
class AxisChoice:
    """One strategy of a node on one mesh axis: the placement each tensor input needs there, the
    placement of each output (None for non-tensor outputs), the rule's Strategy (None for constraints)."""

    inputs: tuple[Pl, ...]
    outputs: tuple[Optional[Pl], ...]
    strategy: Optional[Strategy] = None


@dataclass
class NodeVars:
    """A decision node: its choices per axis, the greedy pick, pairs that split illegally together."""

    axes: list[list[AxisChoice]]
    greedy: tuple[int, ...]
    inputs: list[ValueKey]
    flops: float = 0.0
    invalid: list[tuple[int, int, int, int]] = field(default_factory=list)  # (axis a, choice i, axis b, choice j)


@dataclass
class Problem:
    """The planning problem of one graph, as plain data (no fx nodes)."""

    sizes: tuple[int, ...]
    links: tuple[Link, ...] = ()  # per axis (``cost.links``); empty: every axis alike
    # gradients the bucket pass packs (passes/bucket.py) into buckets of ``bucket_links[a].bucket`` bytes: their
    # last reduction pays its share of one latency, so the plan sees DDP's few large all-reduces, not one each
    bucketed: set[ValueKey] = field(default_factory=set)
    bucket_links: tuple[Link, ...] = ()
    nodes: dict[str, NodeVars] = field(default_factory=dict)
    fixed: dict[ValueKey, Layout] = field(default_factory=dict)  # values whose layout no choice changes
    greedy: dict[ValueKey, Layout] = field(default_factory=dict)  # every value's greedy layout
    nbytes: dict[ValueKey, float] = field(default_factory=dict)
    # values whose Partial sums are reduced in a wider dtype: the factor it widens their bytes by (links_of)
    reduce_scale: dict[ValueKey, float] = field(default_factory=dict)
    scaled_links: dict[tuple, tuple[Link, ...]] = field(default_factory=dict)  # links_of's memo
    required: list[tuple[ValueKey, Layout]] = field(default_factory=list)  # fixed demands (graph outputs)
    # demands that follow a decision node's output (a free parameter's gradient takes its layout)
    tied: list[tuple[ValueKey, str]] = field(default_factory=list)
    # member -> representative: decision nodes that take their representative's choices (fxshard/planner/clusters.py)
    shared: dict[str, str] = field(default_factory=dict)

    def outputs_of(self, u: ValueKey, a: int) -> dict[Pl, list[int]]:
        """The placements value ``u`` may take on axis ``a``, each with the producer's choices giving it."""
        if u in self.fixed:
            return {self.fixed[u][a]: []}
        out: dict[Pl, list[int]] = {}
        for i, c in enumerate(self.nodes[u[0]].axes[a]):
            if c.outputs[u[1]] is not None:
                out.setdefault(c.outputs[u[1]], []).append(i)
        return out


def solve(gm: fx.GraphModule, ctx: ShardContext) -> fx.GraphModule:
    if ctx.planner != "global":
        return gm
    problem = build_problem(gm, ctx)
    if ctx.activation_room is not None:  # auto-sharding's memory budget (fxshard/planner/auto.py); its rows index
        # every node's own columns, so its problem is not clustered
        picks = ctx.solve_within(gm, ctx, problem, _legality(gm, problem))
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
    return solve_problem(problem, _legality(gm, problem))


# ----------------------------------------------------------------------------------------- problem


def _value_of(x: fx.Node) -> ValueKey:
    if x.op == "call_function" and x.target is operator.getitem and isinstance(x.args[0], fx.Node) \
            and isinstance(x.args[0].meta.get(META_KEY), tuple):
        return (x.args[0].name, x.args[1])
    return (x.name, 0)


def _axis_choices(node: fx.Node, problem: Problem, a: int) -> list[AxisChoice]:
    """The rule's strategies on axis ``a`` for the input placements the greedy sweep saw and for every
    placement each input's producer may give (rules offer strided splits only to strided inputs),
    pruned by :func:`_worth` and to splits that are legal on this axis; the greedy strategy first."""
    ins = tensor_inputs(node)
    in_specs = [x.meta[META_KEY] for x in ins]
    offered = [list(problem.outputs_of(_value_of(x), a)) for x in ins]
    base = [s.placements[a] for s in in_specs]
    variants = [base] + [base[:i] + [q] + base[i + 1:] for i, qs in enumerate(offered) for q in qs if q != base[i]]
    rule = None if node.meta.get(FALLBACK_KEY) else lookup(node.target)
    greedy = node.meta[STRATEGY_KEY][a]
    found: dict[tuple, Strategy] = {(greedy.inputs, greedy.output): greedy}
    for pls in variants:
        call = OpCall(node, [s.shape for s in in_specs], pls, out_shape_of(node), [s.dtype for s in in_specs])
        try:
            cands = rule(call, problem.sizes[a]) if rule is not None else [replicate_all(call)]
        except ShardingError:  # a rule refusing a layout the greedy sweep never gave it
            continue
        for st in cands:
            found.setdefault((st.inputs, st.output), st)
    n_out = len(node.meta[META_KEY]) if isinstance(node.meta[META_KEY], tuple) else 1
    # a rule may offer splits that do not divide (checked, as in propagation, on this axis alone here and
    # pairwise across axes by the caller): uneven pieces of such a split differ in size between ranks
    return [AxisChoice(st.inputs, _outputs(st, n_out, node), st) for st in found.values()
            if st is greedy or (_worth(st, offered) and _legal(node, {a: st}, problem.sizes))]


def _outputs(st: Strategy, n_out: int, node: fx.Node) -> tuple[Optional[Pl], ...]:
    spec = node.meta[META_KEY]
    if not isinstance(spec, tuple):
        return (st.output,)
    return tuple(None if spec[j] is None else (st.output[j] if isinstance(st.output, tuple) else st.output) or R
                 for j in range(n_out))


def _worth(st: Strategy, offered: list[list[Pl]]) -> bool:
    """Whether a strategy is worth a variable. One that needs an input ``Partial`` its producer can
    never give is dominated by the replicated strategy (making a replicated value partial only defers a
    reduction), unless another input arrives partial from its producer (``add(P, R)`` zero-fills the
    replicated term). A split or replicated need is always reachable (gather, or slice a replicated
    value)."""
    partial_fed = any(isinstance(p, Part) and p in qs for p, qs in zip(st.inputs, offered))
    return all(not isinstance(p, Part) or p in qs or (partial_fed and p == Part("sum"))
               for p, qs in zip(st.inputs, offered))


def _filler(st: Strategy) -> Strategy:
    """The all-replicated strategy shaped like ``st`` (stands for the axes a legality check leaves out)."""
    out = tuple(None if o is None else R for o in st.output) if isinstance(st.output, tuple) else R
    return Strategy(tuple(R for _ in st.inputs), out)


def _legal(node: fx.Node, by_axis: dict[int, Strategy], sizes: tuple[int, ...]) -> bool:
    """Whether the per-axis strategies ``by_axis`` (other axes replicated) split every tensor legally."""
    in_specs = [x.meta[META_KEY] for x in tensor_inputs(node)]
    filler = _filler(next(iter(by_axis.values())))
    combo = [by_axis.get(a, filler) for a in range(len(sizes))]
    return strategy_valid(combo[-1], combo[:-1], in_specs, out_shape_of(node), sizes, len(sizes),
                          allows_uneven(node.target))


def _constrain_choices(node: fx.Node, problem: Problem, ctx: ShardContext, a: int) -> list[AxisChoice]:
    """A constraint pins some axes; on the others it follows its input, whatever placement that gets."""
    pinned = ctx.constraints[node.args[1]][a]
    greedy = node.meta[IN_KEY][0][a]
    opts = [pinned] if pinned is not None else list(dict.fromkeys(
        [greedy] + list(problem.outputs_of(_value_of(node.args[0]), a))))
    return [AxisChoice((p,), (p,)) for p in opts]


def _flops(node: fx.Node) -> float:
    """Floating-point work of a contraction on global shapes (2 x the product of its einsum's index
    sizes) or of attention (``rules/attention.py::flops``); 0 for other ops, whose work is small next to
    the bytes a plan would move to split it."""
    if node.target in ATTENTION_WORK:
        return attention_flops(node)
    eq = EINSUMS.get(node.target) or ADD_EINSUMS.get(node.target)
    if eq is None:
        return 0.0
    terms = eq.split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for term, x in zip(terms, tensor_inputs(node)[-len(terms):]):
        sizes.update(zip(term, (optimization_hint(d, fallback=64) for d in x.meta["val"].shape)))
    work = 2.0
    for v in sizes.values():
        work *= v
    return work


def build_problem(gm: fx.GraphModule, ctx: ShardContext, free: Optional[dict[str, list[list[Pl]]]] = None,
                  tied: Optional[dict[int, str]] = None) -> Problem:
    """Candidates for every node of a propagated graph, in graph order.

    ``free`` (auto-sharding, ``fxshard/planner/auto.py``): placeholders whose layout is a decision, with their
    candidate placements per axis (the greedy one first); ``tied``: graph output index -> the free
    placeholder whose layout that output must take (a parameter's gradient)."""
    free, tied = free or {}, tied or {}
    problem = Problem(tuple(ctx.mesh.sizes), tuple(ctx.mesh.links))
    if ctx.bucketed:
        problem.bucket_links = tuple(replace(link, bucket=ctx.bucket_mb * 2**20)
                                     for link in (problem.links or (UNIFORM,) * len(problem.sizes)))
    k = len(problem.sizes)
    memo: dict[tuple, tuple[list[list[AxisChoice]], list[tuple[int, int, int, int]]]] = {}  # _signature -> ...
    for node in gm.graph.nodes:
        spec = node.meta.get(META_KEY)
        if node.op == "output":
            req = node.meta.get(IN_KEY) or []  # one per tensor leaf; ctx's tables index every leaf
            for (j, leaf), want in zip(tensor_output_leaves(node), req):
                if j in ctx.bucketed and all(isinstance(s, int) for s in leaf.meta["val"].shape):
                    problem.bucketed.add(_value_of(leaf))  # (bucket.py packs only concrete shapes)
                if j in tied:
                    problem.tied.append((_value_of(leaf), tied[j]))
                elif j < len(ctx.out_required) and ctx.out_required[j] is not None:
                    problem.required.append((_value_of(leaf), tuple(want)))
            continue
        if spec is None or (node.op == "call_function" and node.target is operator.getitem
                            and isinstance(node.args[0].meta.get(META_KEY), tuple)):
            continue
        specs = spec if isinstance(spec, tuple) else (spec,)
        for j, sp in enumerate(specs):
            if isinstance(sp, Spec):
                problem.greedy[(node.name, j)] = sp.placements
                val = node.meta["val"] if not isinstance(spec, tuple) else node.meta["val"][j]
                problem.nbytes[(node.name, j)] = _nbytes(val)
                scale = reduce_scale(val.dtype, ctx.mesh.reduce_dtype)
                if scale != 1.0:
                    problem.reduce_scale[(node.name, j)] = scale
        if node.name in free:
            problem.nodes[node.name] = NodeVars([[AxisChoice((), (p,)) for p in pls] for pls in free[node.name]],
                                                (0,) * k, [])
        elif node.op == "call_function" and node.target is CONSTRAIN_OP:
            axes = [_constrain_choices(node, problem, ctx, a) for a in range(k)]
            problem.nodes[node.name] = NodeVars(axes, (0,) * k, [_value_of(node.args[0])])
        elif node.op == "call_function" and STRATEGY_KEY in node.meta:
            key = _signature(node, problem)
            found = memo.get(key) if key is not None else None
            if found is None:
                found = _candidates(node, problem)
                if key is not None:
                    memo[key] = found
            axes, invalid = found
            problem.nodes[node.name] = NodeVars([list(ax) for ax in axes], (0,) * k,
                                                [_value_of(x) for x in tensor_inputs(node)], _flops(node),
                                                list(invalid))
        elif isinstance(spec, Spec):
            problem.fixed[(node.name, 0)] = spec.placements
    return problem


def _candidates(node: fx.Node, problem: Problem) -> tuple[list[list[AxisChoice]], list[tuple[int, int, int, int]]]:
    """A decision node's choices per axis (:func:`_axis_choices`) and the pairs of per-axis choices that
    split a tensor illegally together."""
    k = len(problem.sizes)
    axes = [_axis_choices(node, problem, a) for a in range(k)]
    invalid = [(a, i, b, j) for a in range(k) for b in range(a + 1, k)
               for i, ca in enumerate(axes[a]) for j, cb in enumerate(axes[b])
               if not _legal(node, {a: ca.strategy, b: cb.strategy}, problem.sizes)]
    return axes, invalid


class _Unkeyed(Exception):
    """An argument that is not plain data: the node's candidates are not memoized."""


def _frozen(v: object, pos: dict[fx.Node, int]) -> object:
    if isinstance(v, fx.Node):
        if v not in pos:
            raise _Unkeyed
        return ("input", pos[v])
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_frozen(x, pos) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((name, _frozen(x, pos)) for name, x in v.items()))
    try:
        hash(v)
    except TypeError:
        raise _Unkeyed from None
    return (type(v).__name__, v)  # the type: 1, 1.0 and True are equal keys


def _signature(node: fx.Node, problem: Problem) -> Optional[tuple]:
    """Everything :func:`_candidates` reads of ``node`` (the op, its non-tensor arguments, input and output
    shapes and dtypes, the greedy strategy, the placements its inputs arrive in and may take, the mesh),
    so that nodes of identical layers share one computation; None when an argument is not plain data.
    Rules see a node only through ``OpCall``: shapes, dtypes, placements, arguments and the output value."""
    ins = tensor_inputs(node)
    pos: dict[fx.Node, int] = {}
    for i, x in enumerate(ins):
        pos.setdefault(x, i)
    try:
        args = _frozen((node.args, node.kwargs), pos)
    except _Unkeyed:
        return None
    val, spec = node.meta.get("val"), node.meta[META_KEY]
    out_dtypes = (tuple(getattr(v, "dtype", None) for v in val) if isinstance(val, (tuple, list))
                  else getattr(val, "dtype", None))
    out_complex = isinstance(val, torch.Tensor) and val.is_complex()
    in_specs = [x.meta[META_KEY] for x in ins]
    per_axis = tuple((tuple(s.placements[a] for s in in_specs),
                      tuple(tuple(problem.outputs_of(_value_of(x), a)) for x in ins),
                      node.meta[STRATEGY_KEY][a]) for a in range(len(problem.sizes)))
    return (node.target, args, tuple((s.shape, s.dtype) for s in in_specs), out_shape_of(node), out_dtypes,
            out_complex, tuple(x is None for x in spec) if isinstance(spec, tuple) else None,
            bool(node.meta.get(FALLBACK_KEY)), problem.sizes, per_axis)


def cluster(gm: fx.GraphModule, problem: Problem) -> dict[str, str]:
    """Layer clustering (``fxshard/planner/clusters.py``): ``member -> representative`` for decision nodes of identical
    repeated blocks, which then share one set of variables. Members have equal candidate lists, legality
    pairs and work; set ``FXSHARD_CLUSTER=0`` to solve without sharing (to compare)."""
    local: dict[str, object] = {u[0]: lay for u, lay in problem.fixed.items()}
    for name, nv in problem.nodes.items():
        local[name] = (tuple(tuple(ax) for ax in nv.axes), tuple(nv.invalid), nv.flops, len(nv.inputs))
    return node_classes(gm, local, set(problem.nodes))


def _legality(gm: fx.GraphModule, problem: Problem):
    """``picks -> [illegal node names]``: the full N-D check pairwise exclusions cannot make on 3+ axes."""
    nodes = {n.name: n for n in gm.graph.nodes}
    k = len(problem.sizes)

    def check(picks: dict[str, tuple[int, ...]]) -> list[str]:
        if k < 3:
            return []
        bad = []
        for name, idx in picks.items():
            nv = problem.nodes[name]
            if nv.axes[0][idx[0]].strategy is None:
                continue
            if not _legal(nodes[name], {a: nv.axes[a][i].strategy for a, i in enumerate(idx)}, problem.sizes):
                bad.append(name)
        return bad

    return check


# ----------------------------------------------------------------------------------------- MILP


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
    each such combination is excluded and the MILP solved again. Logs the problem's size and the
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
                raise ShardingError(f"internal: the global planner's MILP found no plan ({res.message}); "
                                    f"use planner='greedy' and please report this model")
            picks = {name: tuple(int(np.argmax([res.x[i] for i in cols])) for cols in per_axis)
                     for name, per_axis in x.items()}
            bad = illegal(picks)
            if not bad:
                break
            for name in bad:  # exclude this combination of per-axis picks
                m.row([(x[name][a][i], 1.0) for a, i in enumerate(picks[name])], 0.0, len(picks[name]) - 1.0)
        else:
            raise ShardingError(f"internal: the global planner found no legal plan in {MAX_ROUNDS} rounds; "
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


# ----------------------------------------------------------------------------------------- shortcut


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


# ----------------------------------------------------------------------------------------- apply


def apply(gm: fx.GraphModule, ctx: ShardContext, problem: Problem, picks: dict[str, tuple[int, ...]]) -> None:
    """Write the chosen strategies into the node meta propagate defines, in graph order."""
    for node in gm.graph.nodes:
        if node.op == "output":
            req = list(node.meta.get(IN_KEY) or [])  # one per tensor leaf; ctx.out_required indexes every leaf
            for t, (j, leaf) in enumerate(tensor_output_leaves(node)[:len(req)]):
                if j >= len(ctx.out_required) or ctx.out_required[j] is None:
                    req[t] = leaf.meta[META_KEY].placements
            node.meta[IN_KEY] = req
            continue
        if node.op != "call_function":
            continue
        if node.target is operator.getitem and isinstance(node.args[0].meta.get(META_KEY), tuple):
            node.meta[META_KEY] = node.args[0].meta[META_KEY][node.args[1]]
            continue
        if node.name not in picks:
            continue
        chosen = [problem.nodes[node.name].axes[a][i] for a, i in enumerate(picks[node.name])]
        if node.target is CONSTRAIN_OP:
            lay = tuple(c.inputs[0] for c in chosen)
            node.meta[IN_KEY] = [lay]
            node.meta[META_KEY] = node.meta[META_KEY].with_placements(lay)
            continue
        strategies = [c.strategy for c in chosen]
        node.meta[STRATEGY_KEY] = tuple(strategies)
        node.meta[IN_KEY] = [tuple(st.inputs[i] for st in strategies) for i in range(len(strategies[0].inputs))]
        node.meta[META_KEY] = strategy_specs(node, strategies, out_shape_of(node))
