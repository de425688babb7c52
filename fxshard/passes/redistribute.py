"""Pass 4, redistribute: insert the collectives the chosen placements need.

Requires: a propagated graph (``META_KEY`` on values, ``IN_KEY`` on consumers).
Ensures: every op's tensor inputs arrive in the placements its strategy
requires. Each value is redistributed to a given placement once, right before
its first consumer that needs it (the wait directly precedes that use), and
shared by later consumers. Every collective node carries ``COMM_KEY``: kind,
mesh axis, bytes, and why it exists (consuming op and its source line).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..comm.collectives import Emitter, redistribute_nodes
from ..plans.constrain import CONSTRAIN_OP
from ..core.context import ShardContext
from ..core.errors import ShardingError
from ..rules.registry import tensor_inputs
from ..core.ir import IN_KEY, META_KEY, source_line
from ..core.spec import fmt_placements
from ..core.layout import memory_order, pin, reads_strides

__all__ = ["redistribute"]


def redistribute(gm: fx.GraphModule, ctx: ShardContext) -> fx.GraphModule:
    g = gm.graph
    done: dict[tuple[str, tuple], fx.Node] = {}
    for node in list(g.nodes):
        req = node.meta.get(IN_KEY)
        if req is None:
            continue
        ins = tensor_inputs(node)
        remap: dict[fx.Node, list] = {}
        for i, (inp, want) in enumerate(zip(ins, req)):
            spec = inp.meta[META_KEY]
            if tuple(want) == spec.placements:
                continue
            key = (inp.name, tuple(want))
            if key not in done:
                reason = {
                    "consumer": node.name,
                    "op": "output" if node.op == "output" else (
                        "constraint" if node.target is CONSTRAIN_OP else str(node.target)),
                    "source": "" if node.op == "output" else source_line(node),
                    "value": inp.name,
                    "src": fmt_placements(spec.placements),
                    "dst": fmt_placements(want),
                    "graph": ctx.label,
                }
                _dense_only(inp, reason)
                new = redistribute_nodes(Emitter(g, node, reason), inp, spec, want, ctx.mesh)
                if new is not inp:  # the value's global meaning is unchanged; only its layout is
                    new.meta["val"] = inp.meta["val"]
                    new.meta[META_KEY] = spec.with_placements(want)
                    new = _in_traced_order(g, new, inp)
                done[key] = new
            if done[key] is inp:
                continue
            remap.setdefault(inp, []).append((i, done[key]))
        if remap:
            _replace_inputs(node, ins, remap)
    gm.recompile()
    return gm


def _dense_only(inp: fx.Node, reason: dict) -> None:
    """Requires: ``inp`` is about to change placements. Ensures: it is a dense (strided) tensor, else a
    ShardingError: the collectives and slices that change a layout do not take sparse tensors."""
    layout = getattr(inp.meta.get("val"), "layout", torch.strided)
    if layout != torch.strided:
        raise ShardingError(
            f"{inp.name} is a {layout} tensor (from {reason['source'] or 'the traced graph'}) that would have to go "
            f"from {reason['src']} to {reason['dst']} for {reason['op']} in the {reason['graph']} graph, but fxshard "
            f"moves and slices only dense tensors. The usual cause is nn.Embedding(sparse=True) (or "
            f"F.embedding(..., sparse=True)) with a split weight, whose gradient is built sparse: pass "
            f"sparse=False (a split embedding's gradient holds only this rank's rows anyway), or leave that weight "
            f"replicated in the plan")


def _in_traced_order(g: fx.Graph, x: fx.Node, traced: fx.Node) -> fx.Node:
    """``x`` (``traced`` redistributed: collectives and slices make row-major pieces) dense in the dim order
    ``traced`` had while tracing, when that is not row-major (e.g. a transposed product) and a consumer reads
    its strides (``permute`` then ``view``: a view traced on that layout fails on a row-major piece, an
    ``as_strided`` would read other elements). ``contiguous`` copies only when the order differs at run time."""
    val = traced.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 2:
        return x
    order = memory_order(val)
    if order is None or not reads_strides(traced):
        return x
    return pin(g, x, order)


def _replace_inputs(node: fx.Node, ins: list, remap: dict) -> None:
    """Swap tensor input occurrences by position (the same node may appear twice with different needs)."""
    counter = iter(range(len(ins)))
    targets = {}
    for inp, pairs in remap.items():
        for i, new in pairs:
            targets[i] = new

    def sub(a):
        if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
            i = next(counter)
            return targets.get(i, a)
        return a

    from ..core.torch_compat import pytree

    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    flat = [sub(a) for a in flat]
    args, kwargs = pytree.tree_unflatten(flat, spec)
    node.args = args
    node.kwargs = kwargs
