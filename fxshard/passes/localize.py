"""Pass 5, localize: rewrite a global program into this rank's local program.

Requires: a redistributed graph (every op's inputs arrive as its strategy needs).
Ensures: shape-carrying arguments (view/reshape/expand sizes, full-range slice
ends on split dims, the batch size group norm takes, the input size an upsampling
backward takes) hold local sizes; squeezes remove only dims of global size 1 (a
rank's one-element piece of a split dim keeps its dim); ``sym_size`` of a split dim yields the
global size again (so symbolic arithmetic in the graph stays global and is
localized only where it becomes a shape); strategies that need rank-dependent
code are lowered with this rank's coordinates baked in (masked embedding
lookups and gathers over a split range, ``mean`` over a split dim); device
arguments name the runtime device.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..comm.collectives import Emitter
from ..plans.constrain import CONSTRAIN_OP
from ..core.context import ShardContext, runtime_device
from ..core.errors import ShardingError
from ..core.placements import R
from ..rules.registry import norm_dim, tensor_inputs
from ..core.ir import INSERTED_KEY, META_KEY, SHAPE_ARGS, SIZE_ARGS, OpClass, is_op, sharding
from ..comm.lowering import follow_with, set_arg
from ..core.spec import Spec, is_uneven, shard_factor
from ..core.symbolic import is_concrete

aten = torch.ops.aten

__all__ = ["localize", "runtime_device"]



def _local_sizes(e: Emitter, sizes: list, spec: Spec, ctx: ShardContext) -> list:
    """Shape arguments describing ``spec``'s global shape, rewritten to this rank's local shape."""
    local = spec.local_shape(ctx.mesh.sizes, ctx.mesh.coords)
    out = []
    for d, s in enumerate(sizes):
        f = shard_factor(spec.placements, ctx.mesh.sizes, d)
        if f == 1 or (isinstance(s, int) and s == -1):
            out.append(s)
        elif isinstance(s, int) and is_concrete(local[d]):
            out.append(int(local[d]))
        elif isinstance(s, int):
            out.append(s // f)
        else:
            out.append(e.op(operator.floordiv, s, f))
    return out


def _lower(g: fx.Graph, node: fx.Node, ctx: ShardContext) -> None:
    """Apply the rank-dependent lowerings of ``node``'s strategies (each once, with the axes it is on)."""
    rec = sharding(node)
    for low in rec.lowerings:
        fn = getattr(low, "fn", None)
        if fn is None:
            raise ShardingError(f"internal: the strategy of {node.target} names lowering {low!r}, which is not a "
                                f"fxshard.comm.lowering.Lowering (a name with the function that applies it)")
        fn(g, node, ctx, [a for a, st in enumerate(rec.strategy) if st.lowering == low])
        if node.graph is not g or getattr(node, "_erased", False):
            return  # the lowering replaced the node


def localize(gm: fx.GraphModule, ctx: ShardContext) -> fx.GraphModule:
    g = gm.graph
    dev = runtime_device(ctx)
    for node in list(g.nodes):
        if node.op != "call_function" or node.meta.get(INSERTED_KEY):
            continue
        if node.target is CONSTRAIN_OP:  # its input already arrives in the pinned layout
            node.replace_all_uses_with(node.args[0])
            g.erase_node(node)
            continue
        if "device" in node.kwargs:
            node.kwargs = {**node.kwargs, "device": dev}
        if node.target in (aten.sym_size.int, aten.sym_numel.default):
            spec = node.args[0].meta.get(META_KEY)
            if isinstance(spec, Spec):
                _globalize_size(g, node, spec, ctx)
            continue
        spec = node.meta.get(META_KEY)
        if node.target in SHAPE_ARGS and isinstance(spec, Spec):
            i = SHAPE_ARGS[node.target]
            set_arg(node, i, _local_sizes(Emitter(g, node, {}), list(node.args[i]), spec, ctx))
        elif node.target in SIZE_ARGS:
            _localize_size_args(node, ctx)
        elif node.target is aten.slice.Tensor:
            _localize_slice(node, ctx)
        elif node.target in (aten.split.Tensor, aten.split_with_sizes.default):
            _localize_split(node, ctx)
        elif is_op(node.target, OpClass.SQUEEZE):
            _localize_squeeze(node)
        _lower(g, node, ctx)
    gm.recompile()
    return gm


def _globalize_size(g: fx.Graph, node: fx.Node, spec: Spec, ctx: ShardContext) -> None:
    """Make ``sym_size``/``sym_numel`` of a local tensor yield the global value again."""
    sizes = ctx.mesh.sizes
    dims = [norm_dim(node.args[1], spec.ndim)] if node.target is aten.sym_size.int else range(spec.ndim)
    f, local, glob = 1, 1, 1
    for d in dims:
        fd = shard_factor(spec.placements, sizes, d)
        if is_uneven(spec.shape[d], fd):  # static: undo this rank's piece exactly
            local *= int(spec.local_shape(sizes, ctx.mesh.coords)[d])
            glob *= int(spec.shape[d])
        else:
            f *= fd
    if local != glob:
        node = follow_with(g, node, operator.floordiv, local)
        f *= glob
    if f > 1:
        follow_with(g, node, operator.mul, f)


def _localize_size_args(node: fx.Node, ctx: ShardContext) -> None:
    ins = tensor_inputs(node)
    for i, (t, d) in SIZE_ARGS[node.target].items():
        spec = ins[t].meta.get(META_KEY)
        if isinstance(spec, Spec) and shard_factor(spec.placements, ctx.mesh.sizes, d) > 1:
            local = spec.local_shape(ctx.mesh.sizes, ctx.mesh.coords)[d]
            if not is_concrete(local):
                raise ShardingError(f"{node.name}: {node.target} needs a static size for its split dim {d}; "
                                    f"give that dim a static size")
            set_arg(node, i, int(local))


def _localize_squeeze(node: fx.Node) -> None:
    """Squeeze exactly the dims of global size 1: an uneven piece of one element must keep its dim."""
    src = tensor_inputs(node)[0].meta.get(META_KEY)
    if not isinstance(src, Spec) or all(p == R for p in src.placements):
        return
    ndim = src.ndim
    asked = range(ndim) if node.target is aten.squeeze.default else (
        [node.args[1]] if node.target is aten.squeeze.dim else node.args[1])
    dims = sorted({norm_dim(d, max(ndim, 1)) for d in asked})
    node.target = aten.squeeze.dims
    node.args = (node.args[0], [d for d in dims if d < ndim and is_concrete(src.shape[d]) and int(src.shape[d]) == 1])


def _localize_slice(node: fx.Node, ctx: ShardContext) -> None:
    """A full-range slice of a split dim whose end names the global size ends at the local size."""
    src = tensor_inputs(node)[0].meta.get(META_KEY)
    args = list(node.args)
    if not isinstance(src, Spec) or len(args) < 4:
        return
    dim = norm_dim(args[1], src.ndim)
    f = shard_factor(src.placements, ctx.mesh.sizes, dim)
    if f > 1 and isinstance(args[3], int) and is_concrete(src.shape[dim]) and args[3] == int(src.shape[dim]):
        args[3] = int(src.local_shape(ctx.mesh.sizes, ctx.mesh.coords)[dim])
        node.args = tuple(args)


def _localize_split(node: fx.Node, ctx: ShardContext) -> None:
    """A split along a split dim (packed blocks cut apart, ``rules/view.py::_split``) cuts local sizes;
    a split into one chunk (the whole dim, possibly an uneven piece) keeps this rank's whole piece."""
    src = tensor_inputs(node)[0].meta.get(META_KEY)
    if not isinstance(src, Spec):
        return
    args = list(node.args)
    dim = norm_dim(args[2] if len(args) > 2 else node.kwargs.get("dim", 0), src.ndim)
    f = shard_factor(src.placements, ctx.mesh.sizes, dim)
    if f > 1:
        sizes = args[1]
        if is_uneven(src.shape[dim], f):  # only one chunk keeps an uneven split (the rule's)
            local = int(src.local_shape(ctx.mesh.sizes, ctx.mesh.coords)[dim])
            args[1] = [local] if isinstance(sizes, (list, tuple)) else local
        else:
            args[1] = [int(s) // f for s in sizes] if isinstance(sizes, (list, tuple)) else int(sizes) // f
        node.args = tuple(args)
