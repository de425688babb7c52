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
from typing import Any

import torch
import torch.fx as fx

from ..collectives import INSERTED_KEY, Emitter, redistribute_nodes
from ..constrain import CONSTRAIN_OP
from ..context import ShardContext
from ..errors import ShardingError
from ..placements import Part, R, S
from ..registry import norm_dim, tensor_inputs
from ..spec import META_KEY, Spec, chunk, chunk_index, is_uneven, local_shape, shard_factor
from ..symbolic import is_concrete
from .propagate import STRATEGY_KEY

aten = torch.ops.aten

__all__ = ["localize", "runtime_device"]

# op -> position of an argument holding the op's (global) output shape
SHAPE_ARG_OPS = {aten.view.default: 1, aten._unsafe_view.default: 1, aten.reshape.default: 1, aten.expand.default: 1,
                 aten.upsample_bilinear2d_backward.default: 2, aten._upsample_bilinear2d_aa_backward.default: 2}
# op -> {argument position: (tensor input, dim)}: an int argument holding the size of that input's dim
SIZE_ARGS = {aten.native_group_norm.default: {3: (0, 0)}, aten.native_group_norm_backward.default: {5: (0, 0)}}
SQUEEZE_OPS = {aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims}


def runtime_device(ctx: ShardContext) -> torch.device:
    if ctx.mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(ctx.mesh.device_type)


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


def _chunk_start(spec: Spec, dim: int, ctx: ShardContext) -> tuple[Any, Any]:
    """(global index of this rank's first element along ``dim``, local size of ``dim``)."""
    m = ctx.mesh
    ld = spec.local_shape(m.sizes, m.coords)[dim]
    size, f = spec.shape[dim], shard_factor(spec.placements, m.sizes, dim)
    idx = chunk_index(spec.placements, m.sizes, m.coords, dim)
    if is_uneven(size, f):
        return chunk(int(size), f, idx)[0], ld
    return idx * ld, ld


def _shifted_index(e: Emitter, node: fx.Node, table: fx.Node, idx: fx.Node, dim: int, ctx: ShardContext
                   ) -> tuple[fx.Node, fx.Node]:
    """(index into this rank's range of a table split on ``dim`` with misses set to 0, miss mask)."""
    spec = table.meta[META_KEY]
    start, ld = _chunk_start(spec, dim, ctx)
    if not is_concrete(ld):
        raise ShardingError(f"{node.name}: a symbolic split size in a masked lookup is not supported; "
                            f"give the split table dim a static size")
    ld = int(ld)
    shifted = e.op(aten.sub.Tensor, idx, int(start))
    miss = e.op(aten.logical_or.default, e.op(aten.lt.Scalar, shifted, 0), e.op(aten.ge.Scalar, shifted, ld))
    return e.op(aten.masked_fill.Scalar, shifted, miss, 0), miss


def _follow_with(g: fx.Graph, node: fx.Node, target: Any, *args: Any) -> fx.Node:
    """Insert ``target(node, *args)`` right after ``node`` and make every other user read it instead."""
    with g.inserting_after(node):
        out = g.call_function(target, (node, *args))
    out.meta[INSERTED_KEY] = True
    out.meta["val"] = node.meta.get("val")
    out.meta[META_KEY] = node.meta.get(META_KEY)
    for user in list(node.users):
        if user is not out:
            user.replace_input_with(node, out)
    return out


def _zero_misses_after(g: fx.Graph, node: fx.Node, miss: fx.Node, unsqueeze: bool) -> None:
    """Replace ``node``'s uses by ``node`` with the positions in ``miss`` zeroed."""
    mask = Emitter(g, node, {}).op(aten.unsqueeze.default, miss, -1) if unsqueeze else miss
    _follow_with(g, node, aten.masked_fill.Scalar, mask, 0.0)


def _set_arg(node: fx.Node, i: int, value: Any) -> None:
    args = list(node.args)
    args[i] = value
    node.args = tuple(args)


def _lower(g: fx.Graph, node: fx.Node, ctx: ShardContext) -> None:
    strategies = node.meta.get(STRATEGY_KEY) or ()
    lowerings = {st.lowering for st in strategies if st.lowering}
    if not lowerings:
        return
    ins = tensor_inputs(node)
    e = Emitter(g, node, {})
    if "masked_embedding" in lowerings:  # embedding(table, idx): look up hits, zero the rows of misses
        safe, miss = _shifted_index(e, node, ins[0], node.args[1], 0, ctx)
        _set_arg(node, 1, safe)
        _zero_misses_after(g, node, miss, unsqueeze=True)
    if "masked_embedding_backward" in lowerings:  # embedding_dense_backward(g, idx, V, pad, freq): own rows only
        safe, miss = _shifted_index(e, node, node, node.args[1], 0, ctx)
        pad = node.args[3]
        if pad >= 0:  # the padding row gets no gradient: drop its tokens like misses
            miss = e.op(aten.logical_or.default, miss, e.op(aten.eq.Scalar, node.args[1], pad))
        g = e.op(aten.masked_fill.Scalar, node.args[0], e.op(aten.unsqueeze.default, miss, -1), 0.0)
        node.args = (g, safe, int(_chunk_start(node.meta[META_KEY], 0, ctx)[1]), -1) + tuple(node.args[4:])
    if "masked_gather" in lowerings:  # gather(x, dim, idx)
        dim = norm_dim(node.args[1], len(ins[0].meta[META_KEY].shape))
        safe, miss = _shifted_index(e, node, ins[0], node.args[2], dim, ctx)
        _set_arg(node, 2, safe)
        _zero_misses_after(g, node, miss, unsqueeze=False)
    if "masked_index_put" in lowerings:  # index_put(self, [idx], values, accumulate=True): add zeros for misses
        safe, miss = _shifted_index(e, node, ins[0], node.args[1][0], 0, ctx)
        values = node.args[2]
        masked = e.op(aten.masked_fill.Scalar, values, _bcast_mask(e, miss, node, values), 0.0)
        _set_arg(node, 1, [safe])
        _set_arg(node, 2, masked)
    if "masked_scatter_add" in lowerings:  # scatter_add(self, dim, idx, src): add zeros for misses
        dim = norm_dim(node.args[1], len(ins[0].meta[META_KEY].shape))
        safe, miss = _shifted_index(e, node, ins[0], node.args[2], dim, ctx)
        masked = e.op(aten.masked_fill.Scalar, node.args[3], miss, 0.0)
        _set_arg(node, 2, safe)
        _set_arg(node, 3, masked)
    if "global_rng" in lowerings:  # a random op on a split output: draw globally, keep this rank's chunk
        _global_draw(g, node, ctx)
        return
    if "mean_as_sum" in lowerings:  # local mean * local count / global count = this rank's term of the sum
        spec = ins[0].meta[META_KEY]
        m = ctx.mesh
        f, ratio = 1, 1.0
        for a, st in enumerate(strategies):
            p = spec.placements[a]
            if st.lowering != "mean_as_sum" or not isinstance(p, S):
                continue
            if is_uneven(spec.shape[p.dim], m.sizes[a]):
                ratio *= int(spec.local_shape(m.sizes, m.coords)[p.dim]) / int(spec.shape[p.dim])
            else:
                f *= m.sizes[a]
        if ratio == 1.0:
            _follow_with(g, node, aten.div.Scalar, f)
        else:
            _follow_with(g, node, aten.mul.Scalar, ratio / f)


def _global_draw(g: fx.Graph, node: fx.Node, ctx: ShardContext) -> None:
    """Replace a random op whose output is split by a draw of its GLOBAL shape cut to this rank's chunk.

    Every rank draws the same numbers and advances the generator as the unsharded program does
    (semantics in ``fxshard/rules/random.py``). ``native_dropout`` becomes ``x * mask * scale`` with the
    mask drawn as eager dropout draws it (``bernoulli_(1 - p)`` in ``x``'s dtype) and kept as a local bool.
    """
    x = tensor_inputs(node)[0]
    spec: Spec = x.meta[META_KEY]
    dropout = node.target is aten.native_dropout.default
    out_specs = node.meta[META_KEY] if dropout else (node.meta[META_KEY],)
    e = Emitter(g, node, {})
    lshape = local_shape(spec.shape, spec.placements, ctx.mesh.sizes, ctx.mesh.coords)
    gshape = []
    for d, (s, ls) in enumerate(zip(spec.shape, lshape)):
        f = shard_factor(spec.placements, ctx.mesh.sizes, d)
        gshape.append(int(s) if is_concrete(s) else e.arith(operator.mul, e.size(x, d, ls), f) if f > 1
                      else e.size(x, d, ls))
    blank = e.op(aten.empty.memory_format, gshape, dtype=spec.dtype, device=runtime_device(ctx))
    if dropout:
        p = float(node.args[1])
        draw = e.op(aten.bernoulli.p, blank, 1.0 - p)
    else:
        draw = e.op(node.target, blank, *node.args[1:], **node.kwargs)
    dst = [R if isinstance(pl, Part) else pl for pl in out_specs[-1].placements]
    glob = Spec((R,) * len(dst), spec.shape, spec.dtype if dropout else out_specs[0].dtype)
    chunk = redistribute_nodes(e, draw, glob, dst, ctx.mesh)
    if dropout:  # a copy, so the global draw dies here and the backward saves only the local bool mask
        mask = e.op(aten._to_copy.default, chunk, dtype=torch.bool)
        out = e.op(aten.mul.Tensor, e.op(aten.mul.Tensor, x, mask), 1.0 / (1.0 - p) if p < 1 else 0.0)
        results = [out, mask]
    else:
        results = [e.contiguous(chunk)]
    for i, r in enumerate(results):  # the results stand for the op in explain(): not "inserted"
        r.meta.pop(INSERTED_KEY, None)
        r.meta.update({k: node.meta[k] for k in ("stack_trace", STRATEGY_KEY) if k in node.meta})
        r.meta["val"] = node.meta["val"][i] if dropout else node.meta["val"]
        r.meta[META_KEY] = out_specs[i]
    if dropout:
        for user in list(node.users):  # getitem(native_dropout, i)
            user.replace_all_uses_with(results[user.args[1]])
            g.erase_node(user)
    else:
        node.replace_all_uses_with(results[0])
    g.erase_node(node)


def _bcast_mask(e: Emitter, miss: fx.Node, node: fx.Node, values: fx.Node) -> fx.Node:
    """``miss`` (index shape) unsqueezed on the right to broadcast over ``values`` rows."""
    extra = len(values.meta["val"].shape) - len(node.args[1][0].meta["val"].shape)
    for _ in range(extra):
        miss = e.op(aten.unsqueeze.default, miss, -1)
    return miss


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
        if node.target in SHAPE_ARG_OPS and isinstance(spec, Spec):
            i = SHAPE_ARG_OPS[node.target]
            _set_arg(node, i, _local_sizes(Emitter(g, node, {}), list(node.args[i]), spec, ctx))
        elif node.target in SIZE_ARGS:
            _localize_size_args(node, ctx)
        elif node.target is aten.slice.Tensor:
            _localize_slice(node, ctx)
        elif node.target in (aten.split.Tensor, aten.split_with_sizes.default):
            _localize_split(node, ctx)
        elif node.target in SQUEEZE_OPS:
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
        node = _follow_with(g, node, operator.floordiv, local)
        f *= glob
    if f > 1:
        _follow_with(g, node, operator.mul, f)


def _localize_size_args(node: fx.Node, ctx: ShardContext) -> None:
    ins = tensor_inputs(node)
    for i, (t, d) in SIZE_ARGS[node.target].items():
        spec = ins[t].meta.get(META_KEY)
        if isinstance(spec, Spec) and shard_factor(spec.placements, ctx.mesh.sizes, d) > 1:
            local = spec.local_shape(ctx.mesh.sizes, ctx.mesh.coords)[d]
            if not is_concrete(local):
                raise ShardingError(f"{node.name}: {node.target} needs a static size for its split dim {d}; "
                                    f"give that dim a static size")
            _set_arg(node, i, int(local))


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
