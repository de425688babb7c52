"""The global planner's choice problem: per decision node and mesh axis, the strategies its rule admits,
as plain data (:class:`Problem`, no fx nodes), and the price of a layout change on it (:func:`price`).

Requires (``build_problem``): a propagated graph (``META_KEY``, ``IN_KEY``, ``STRATEGY_KEY`` from the greedy
sweep, which seeds the candidates, prices the other mesh axes and breaks ties).
Ensures: a :class:`Problem` whose decision nodes hold their candidate choices per axis (the greedy one
first), the pairs of per-axis choices that split a tensor illegally together, and their work; seeds
(parameters, inputs), constraints and required outputs are fixed data, never variables. ``cluster``
names the decision nodes of identical repeated blocks (``planner/clusters.py``); ``legality`` checks a
plan's N-D legality on 3+ axes. The MILP over it is ``planner/formulate.py``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.fx as fx

from .clusters import node_classes
from ..plans.constrain import CONSTRAIN_OP
from ..core.context import ShardContext
from .cost import UNIFORM, Link, transition_cost
from ..comm.transition import reduce_scale
from ..core.errors import ShardingError
from ..core.placements import Part, Pl, R, S
from ..rules.registry import (OpCall, Strategy, allows_uneven, lookup, out_shape_of, replicate_all,
                        strategy_valid, tensor_inputs, tensor_output_leaves)
from ..rules.attention import WORK as ATTENTION_WORK, flops as attention_flops
from ..rules.matmul import ADD_EINSUMS, EINSUMS
from ..core.spec import Spec
from ..core.ir import FALLBACK_KEY, IN_KEY, META_KEY, STRATEGY_KEY
from ..core.torch_compat import optimization_hint

__all__ = ["Layout", "ValueKey", "price", "links_of", "AxisChoice", "NodeVars", "Problem", "build_problem",
           "cluster", "legality"]

Layout = tuple[Pl, ...]  # one placement per mesh axis
ValueKey = tuple[str, int]  # (producing node's name, output index; 0 for single-output nodes)


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


def legality(gm: fx.GraphModule, problem: Problem):
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
