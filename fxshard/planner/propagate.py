"""Pass 3, propagate: give every tensor-valued node a Spec.

Requires: a traced graph (``meta["val"]`` on every node) and a context whose
seeds hold the frozen placements of placeholders.
Ensures: ``meta[META_KEY]`` on every tensor node (a tuple of Specs for
multi-output ops), ``meta[IN_KEY]`` on every op and on the output node: the
placements each tensor input must have, and ``meta[STRATEGY_KEY]``: the
per-axis Strategy chosen. Seeds are never changed. Among the strategies an
op's rule admits, each mesh axis takes the one with the least redistribution
cost (bytes moved), counting a redistribution another consumer already paid
for as free, so a value is all-reduced once however many ops read it.
Ops without a rule fall back to all-replicated with a one-time warning.
A backward sweep then lets an op whose only consumer wants another layout
produce it directly when that is cheaper, repeated to a fixed point.
"""

from __future__ import annotations

import operator
import warnings
from contextvars import ContextVar
from typing import Sequence

import torch
import torch.fx as fx

from ..core.context import ShardContext
from .cost import axis_link, transition_cost
from ..core.errors import ShardingError
from ..core.placements import Part, Pl, R
from ..rules.registry import (OpCall, Strategy, allows_uneven, lookup, out_shape_of, replicate_all,
                        strategy_specs, strategy_valid, tensor_inputs, tensor_output_leaves)
from ..plans.constrain import CONSTRAIN_OP
from ..core.ir import (FALLBACK_KEY, IN_KEY, META_KEY, STRATEGY_KEY, NodeSharding, OpClass, is_op, set_sharding, source_line,
                  spec_of)
from ..core.spec import Spec, fmt_placements, shard_factor, split_ok
from ..core.symbolic import is_concrete, sym_shape
from ..core.torch_compat import OpOverload, optimization_hint

__all__ = ["propagate", "IN_KEY", "STRATEGY_KEY", "FALLBACK_KEY", "spec_of"]

# the ops whose fallback has been warned about in this context (an immutable set: a context copied
# with contextvars starts from its parent's and adds its own)
_WARNED: ContextVar[frozenset] = ContextVar("fxshard_fallback_warned", default=frozenset())


def _nbytes(val: torch.Tensor) -> float:
    n = 1
    for s in val.shape:
        n *= optimization_hint(s, fallback=64)
    return float(n * val.dtype.itemsize)


def _dynamic_hint(shape: Sequence, pls: Sequence[Pl], sizes: Sequence[int]) -> str:
    """How to declare a dynamic dim so a split of it provably divides ('' when no split dim is dynamic)."""
    for d, size in enumerate(shape):
        f = shard_factor(pls, sizes, d)
        if f > 1 and not is_concrete(size):
            return (f"; dim {d} ({size}) is dynamic: declare it as a multiple of {f} in dynamic_shapes, "
                    f"e.g. {{{d}: {f} * torch.export.Dim('n')}}")
    return ""


def _warn_fallback(ctx: ShardContext, node: fx.Node) -> None:
    name = str(node.target)
    ctx.fallbacks.append(name)
    warned = _WARNED.get()
    if name not in warned:
        _WARNED.set(warned | {name})
        warnings.warn(
            f"fxshard: no sharding rule for {name}; computing it on replicated inputs (all-gathered first). "
            f"The result is correct but costs communication and memory; see fxshard.explain() for where it runs.",
            stacklevel=3,
        )


def propagate(gm: fx.GraphModule, ctx: ShardContext) -> fx.GraphModule:
    mesh = ctx.mesh
    sizes = mesh.sizes
    k = len(sizes)
    avail: dict[tuple[str, int], set] = {}

    def cost_of(inp: fx.Node, cur: Pl, dst: Pl, axis: int) -> float:
        if isinstance(cur, Part) and cur == dst and len(inp.users) > 1 and R not in avail.get((inp.name, axis), ()):
            # a Partial that fans out is reduced once, at the fan-out point (Megatron's f/g): each consumer
            # keeping it Partial would otherwise end in a reduction of its own
            return transition_cost(cur, R, _nbytes(inp.meta["val"]), sizes[axis],
                                   axis_link(mesh, axis, inp.meta["val"].dtype))
        if cur == dst or dst in avail.get((inp.name, axis), ()):
            return 0.0
        return transition_cost(cur, dst, _nbytes(inp.meta["val"]), sizes[axis],
                               axis_link(mesh, axis, inp.meta["val"].dtype))

    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder":
            if isinstance(val, torch.Tensor):
                pls = ctx.seeds.get(node, (R,) * k)
                spec = Spec(tuple(pls), sym_shape(val), val.dtype)
                if not split_ok(spec.shape, spec.placements, sizes, uneven=True):
                    raise ShardingError(
                        f"{node.name} of shape {tuple(spec.shape)} cannot be split as {spec} over mesh axes "
                        f"{dict(zip(mesh.names, sizes))}: a split dim neither divides nor can be cut unevenly "
                        f"(that needs a static size, one mesh axis and an element on every rank); choose a spec "
                        f"whose split dims divide evenly{_dynamic_hint(spec.shape, spec.placements, sizes)}"
                    )
                node.meta[META_KEY] = spec
            continue
        if node.op == "output":
            _require_outputs(node, ctx)
            continue
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            base = node.args[0].meta.get(META_KEY)
            if isinstance(base, tuple):
                node.meta[META_KEY] = base[node.args[1]]
            continue
        if node.target is CONSTRAIN_OP:
            cur = node.args[0].meta[META_KEY]
            want = tuple(c if w is None else w for w, c in zip(ctx.constraints[node.args[1]], cur.placements))
            if not split_ok(cur.shape, want, sizes, uneven=True):
                raise ShardingError(
                    f"constraint {fmt_placements(want)} at {source_line(node) or node.name} does not divide the "
                    f"value of shape {tuple(cur.shape)} over mesh axes {dict(zip(mesh.names, sizes))}; "
                    f"constrain to a layout whose split dims divide evenly{_dynamic_hint(cur.shape, want, sizes)}"
                )
            node.meta[IN_KEY] = [want]
            node.meta[META_KEY] = cur.with_placements(want)
            continue
        out_shape = out_shape_of(node)
        if out_shape is None or not isinstance(node.target, OpOverload):
            continue
        ins = tensor_inputs(node)
        in_specs = [n.meta[META_KEY] for n in ins]
        rule = lookup(node.target)
        uneven = allows_uneven(node.target)
        if rule is None:
            _warn_fallback(ctx, node)
        chosen: list[Strategy] = []
        for a in range(k):
            call = OpCall(node, [s.shape for s in in_specs], [s.placements[a] for s in in_specs], out_shape,
                          [s.dtype for s in in_specs])
            cands = rule(call, sizes[a]) if rule is not None else [replicate_all(call)]
            best, best_cost = None, float("inf")
            for st in cands:
                if not strategy_valid(st, chosen, in_specs, out_shape, sizes, k, uneven):
                    continue
                c = sum(cost_of(i, s.placements[a], p, a) for i, s, p in zip(ins, in_specs, st.inputs))
                if c < best_cost:
                    best, best_cost = st, c
            if best is None:
                best = replicate_all(call)
            chosen.append(best)
        _replicate_at_base(ins, chosen, avail)
        in_specs = [n.meta[META_KEY] for n in ins]
        for a, st in enumerate(chosen):
            for i, s, p in zip(ins, in_specs, st.inputs):
                if p != s.placements[a]:
                    avail.setdefault((i.name, a), set()).add(p)
        set_sharding(node, NodeSharding(strategy_specs(node, chosen, out_shape),
                                        tuple(tuple(st.inputs[i] for st in chosen) for i in range(len(ins))),
                                        tuple(chosen), fallback=rule is None,
                                        why=f"no sharding rule for {node.target}" if rule is None else ""))
    _refine(gm, ctx)
    return gm


def _replicate_at_base(ins: list[fx.Node], chosen: list[Strategy], avail: dict) -> None:
    """Where an op needs an input replicated that is a one-user permute/view of another value, replicate
    that value instead and let the view map ``R`` to ``R``: the same bytes move, but the replicated base
    is then available to the base's other consumers (a linear's backward reads ``g`` for the input
    gradient and ``permute(g)`` for the weight gradient: one gather serves both)."""
    for a, st in enumerate(chosen):
        for x in {x for x, want in zip(ins, st.inputs) if want == R}:
            if any(y is x and want != R for y, want in zip(ins, st.inputs)):
                continue
            while (x.op == "call_function" and is_op(x.target, OpClass.BASE_VIEW) and len(x.users) == 1
                   and STRATEGY_KEY in x.meta and not x.meta.get(FALLBACK_KEY)):
                spec = x.meta[META_KEY]
                base = tensor_inputs(x)[0]
                if spec.placements[a] == R or x.meta[IN_KEY][0][a] != base.meta[META_KEY].placements[a]:
                    break  # already replicated, or a redistribution already sits between base and view
                strategies = list(x.meta[STRATEGY_KEY])
                strategies[a] = Strategy((R,), R)
                x.meta[STRATEGY_KEY] = tuple(strategies)
                x.meta[IN_KEY] = [tuple(R if b == a else p for b, p in enumerate(x.meta[IN_KEY][0]))]
                x.meta[META_KEY] = spec.with_placements(tuple(R if b == a else p
                                                              for b, p in enumerate(spec.placements)))
                avail.setdefault((base.name, a), set()).add(R)
                x = base


def _refine(gm: fx.GraphModule, ctx: ShardContext, max_rounds: int = 4) -> None:
    """Backward sweep to a fixed point: an op whose only consumer needs its result in another layout
    switches to a strategy producing that layout directly when that moves fewer bytes than computing
    and then redistributing (e.g. an FSDP update reduce-scatters the gradient instead of gathering the
    parameter and reduce-scattering the result). Axis by axis: an axis switches only where that saves,
    others keep their strategy (a data-parallel embedding gradient stays ``P(sum)`` on dp, reduced at
    the output with the other gradients, while tp switches to the masked vocab-parallel rows). Each
    switch strictly lowers the cost, so it ends."""
    sizes = ctx.mesh.sizes
    k = len(sizes)

    def tc(x: fx.Node, src: Pl, dst: Pl, a: int) -> float:
        return 0.0 if src == dst else transition_cost(src, dst, _nbytes(x.meta["val"]), sizes[a],
                                                      axis_link(ctx.mesh, a, x.meta["val"].dtype))

    for _ in range(max_rounds):
        changed = False
        for node in reversed(list(gm.graph.nodes)):
            spec = node.meta.get(META_KEY)
            if (node.op != "call_function" or STRATEGY_KEY not in node.meta or node.meta.get(FALLBACK_KEY)
                    or not isinstance(spec, Spec) or len(node.users) != 1):
                continue
            user = next(iter(node.users))
            req = user.meta.get(IN_KEY)
            if req is None:
                continue
            wants = {tuple(req[i]) for i, x in enumerate(tensor_inputs(user)) if x is node}
            if len(wants) != 1:
                continue
            want = wants.pop()
            if want == spec.placements:
                continue
            ins = tensor_inputs(node)
            in_specs = [x.meta[META_KEY] for x in ins]
            cur_req = node.meta[IN_KEY]
            rule = lookup(node.target)
            chosen: list[Strategy] = []
            switched = False
            for a in range(k):
                call = OpCall(node, [s.shape for s in in_specs], [s.placements[a] for s in in_specs], spec.shape,
                              [s.dtype for s in in_specs])
                best, best_cost = None, float("inf")
                for st in rule(call, sizes[a]):
                    if st.output != want[a] or not strategy_valid(st, chosen, in_specs, spec.shape, sizes, k,
                                                          allows_uneven(node.target)):
                        continue
                    c = sum(tc(x, s.placements[a], p, a) for x, s, p in zip(ins, in_specs, st.inputs))
                    if c < best_cost:
                        best, best_cost = st, c
                cur = sum(tc(x, s.placements[a], r[a], a) for x, s, r in zip(ins, in_specs, cur_req))
                cur += tc(node, spec.placements[a], want[a], a)
                if best is not None and best_cost < cur * 0.999:  # a real saving, not a tie broken by epsilons
                    chosen.append(best)
                    switched = True
                    continue
                # no strategy on this axis gives the wanted layout for less: the axis keeps its own
                best = node.meta[STRATEGY_KEY][a]
                if not strategy_valid(best, chosen, in_specs, spec.shape, sizes, k, allows_uneven(node.target)):
                    break
                chosen.append(best)
            if len(chosen) == k and switched:
                node.meta[STRATEGY_KEY] = tuple(chosen)
                node.meta[IN_KEY] = [tuple(st.inputs[i] for st in chosen) for i in range(len(ins))]
                node.meta[META_KEY] = spec.with_placements(tuple(st.output for st in chosen))
                changed = True
        if not changed:
            return


def _require_outputs(node: fx.Node, ctx: ShardContext) -> None:
    req = []
    for j, leaf in tensor_output_leaves(node):
        want = ctx.out_required[j] if j < len(ctx.out_required) else None
        cur = leaf.meta[META_KEY]
        if want is not None and not split_ok(cur.shape, want, ctx.mesh.sizes, uneven=True):
            raise ShardingError(
                f"output {j} of shape {tuple(cur.shape)} cannot be returned as {want}: a split dim is not "
                f"divisible by its mesh axis; use out_specs that divide evenly (or Replicate())"
            )
        req.append(tuple(want) if want is not None else cur.placements)
    node.meta[IN_KEY] = req
