"""Embedding lookups and gathers along a split dim become masked local lookups + ``P(sum)``."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..comm.collectives import Emitter
from ..core.context import ShardContext
from ..core.ir import META_KEY
from ..comm.lowering import Lowering, chunk_start, set_arg, shifted_index, zero_misses_after
from ..core.placements import Part, R, S
from .registry import OpCall, Strategy, norm_dim, outer_of, register, tensor_inputs
from ..core.spec import can_split
from ..core.symbolic import equal

aten = torch.ops.aten


# ---- lowerings: this rank holds a range of a table split on a dim; indices outside it are misses

def _masked_embedding(g: fx.Graph, node: fx.Node, ctx: ShardContext, axes: list[int]) -> None:
    """``embedding(table, idx)``: look up hits, zero the rows of misses."""
    safe, miss = shifted_index(Emitter(g, node, {}), node, tensor_inputs(node)[0], node.args[1], 0, ctx)
    set_arg(node, 1, safe)
    zero_misses_after(g, node, miss, unsqueeze=True)


def _masked_embedding_backward(g: fx.Graph, node: fx.Node, ctx: ShardContext, axes: list[int]) -> None:
    """``embedding_dense_backward(grad, idx, V, pad, freq)``: gradients of this rank's rows only."""
    e = Emitter(g, node, {})
    safe, miss = shifted_index(e, node, node, node.args[1], 0, ctx)
    pad = node.args[3]
    if pad >= 0:  # the padding row gets no gradient: drop its tokens like misses
        miss = e.op(aten.logical_or.default, miss, e.op(aten.eq.Scalar, node.args[1], pad))
    grad = e.op(aten.masked_fill.Scalar, node.args[0], e.op(aten.unsqueeze.default, miss, -1), 0.0)
    node.args = (grad, safe, int(chunk_start(node.meta[META_KEY], 0, ctx)[1]), -1) + tuple(node.args[4:])


def _masked_gather(g: fx.Graph, node: fx.Node, ctx: ShardContext, axes: list[int]) -> None:
    """``gather(x, dim, idx)``: gather hits, zero misses."""
    x = tensor_inputs(node)[0]
    dim = norm_dim(node.args[1], len(x.meta[META_KEY].shape))
    safe, miss = shifted_index(Emitter(g, node, {}), node, x, node.args[2], dim, ctx)
    set_arg(node, 2, safe)
    zero_misses_after(g, node, miss, unsqueeze=False)


def _masked_index_put(g: fx.Graph, node: fx.Node, ctx: ShardContext, axes: list[int]) -> None:
    """``index_put(self, [idx], values, accumulate=True)``: add zeros for misses."""
    e = Emitter(g, node, {})
    # eager index_put reads a negative index from the end of the dim (embedding, gather, scatter_add reject it)
    safe, miss = shifted_index(e, node, tensor_inputs(node)[0], node.args[1][0], 0, ctx, negative_wraps=True)
    values = node.args[2]
    extra = len(values.meta["val"].shape) - len(node.args[1][0].meta["val"].shape)
    for _ in range(extra):  # broadcast the index-shaped mask over the rows of values
        miss = e.op(aten.unsqueeze.default, miss, -1)
    set_arg(node, 1, [safe])
    set_arg(node, 2, e.op(aten.masked_fill.Scalar, values, miss, 0.0))


def _masked_scatter_add(g: fx.Graph, node: fx.Node, ctx: ShardContext, axes: list[int]) -> None:
    """``scatter_add(self, dim, idx, src)``: add zeros for misses."""
    x, idx = tensor_inputs(node)[0], node.args[2]
    dim = norm_dim(node.args[1], len(x.meta[META_KEY].shape))
    e = Emitter(g, node, {})
    safe, miss = shifted_index(e, node, x, idx, dim, ctx)
    set_arg(node, 2, safe)
    set_arg(node, 3, e.op(aten.masked_fill.Scalar, _leading_part(e, node.args[3], idx), miss, 0.0))


def _leading_part(e: Emitter, src: fx.Node, idx: fx.Node) -> fx.Node:
    """``src[:idx.shape[0], :idx.shape[1], ...]``: the part a scatter reads (torch allows an index smaller
    than ``src`` on any dim). Requires both replicated (their local shapes are their global ones)."""
    want = idx.meta[META_KEY].shape
    for d, (have, size) in enumerate(zip(src.meta[META_KEY].shape, want)):
        if not equal(have, size):
            src = e.op(aten.slice.Tensor, src, d, 0, e.size(idx, d, size))
    return src


MASKED_EMBEDDING = Lowering("masked_embedding", _masked_embedding)
MASKED_EMBEDDING_BACKWARD = Lowering("masked_embedding_backward", _masked_embedding_backward)
MASKED_GATHER = Lowering("masked_gather", _masked_gather)
MASKED_INDEX_PUT = Lowering("masked_index_put", _masked_index_put)
MASKED_SCATTER_ADD = Lowering("masked_scatter_add", _masked_scatter_add)


@register(aten.embedding.default)
def embedding_rule(call: OpCall, n: int) -> list[Strategy]:
    """``embedding(weight[V, D], idx)``: split D (colwise), split V (masked lookup, Partial),
    or split the indices (batch)."""
    v, d = call.in_shapes[0]
    out_nd = len(call.out_shape)
    res = [Strategy((R, R), R)]
    if can_split(d, n):
        res.append(Strategy((S(1), R), S(out_nd - 1)))
    if can_split(v, n):
        res.append(Strategy((S(0), R), Part(), lowering=MASKED_EMBEDDING))
    res += [Strategy((R, p), p) for p in _index_splits(call, n)]
    return res


def _index_splits(call: OpCall, n: int) -> list[S]:
    """Every split of the indices (input 1) over ``n`` ranks, strided as the indices arrive."""
    cur = call.in_pls[1]
    res = []
    for i, size in enumerate(call.in_shapes[1]):
        o = outer_of(cur, i)
        if can_split(size, n, o):
            res.append(S(i, o))
    return res


@register(aten.embedding_dense_backward.default)
def embedding_backward_rule(call: OpCall, n: int) -> list[Strategy]:
    """``embedding_dense_backward(g[*idx, D], idx, V, padding_idx, scale_grad_by_freq) -> [V, D]``: the
    forward's splits seen from the gradient.

    Split D of ``g`` (colwise); split V with a masked local accumulation (each rank adds the rows of
    the indices in its range, the ``masked_embedding_backward`` lowering; not with ``scale_grad_by_freq``,
    whose per-row counts the redirected misses would change); or a ``P(sum)`` ``g`` (linear).

    Indices that arrive split (the batch of data parallelism) are a policy, as in DDP / FSDP: each rank
    accumulates its own tokens' rows into a ``P(sum)`` table, whose reduction (an all-reduce, or a
    reduce-scatter into an FSDP-split table) is the only strategy offered, never a gather of the
    activation gradient over that axis, even where the gather sends fewer bytes (fewer tokens than
    ``2 V / tp``): the gather's bytes and its transient buffer grow with the batch and sit on the
    backward's critical path, the table's reduction is fixed-size, bucketed with the other weight
    gradients and overlaps the backward. Not with ``scale_grad_by_freq`` (the per-row counts would be
    this rank's). Replicated indices are not sliced for it: that would invent a split whose table
    reduction the greedy per-op price cannot see (Megatron-SP gathers the gradient there).
    """
    g = call.in_shapes[0]
    v, d = call.out_shape
    if not call.arg(4, "scale_grad_by_freq", False) and call.in_pls[1] in _index_splits(call, n):
        return [Strategy((call.in_pls[1], call.in_pls[1]), Part())]
    res = []
    if can_split(v, n) and not call.arg(4, "scale_grad_by_freq", False):
        # first: where it ties with the replicated table (both read g replicated), the greedy sweep keeps
        # the vocab-parallel rows, so a P(sum) table on a data-parallel axis is reduced at 1/n its size
        res.append(Strategy((R, R), S(0), lowering=MASKED_EMBEDDING_BACKWARD))
    res += [Strategy((R, R), R), Strategy((Part(), R), Part())]
    if can_split(d, n):
        res.append(Strategy((S(len(g) - 1), R), S(1)))
    return res


@register(aten.gather.default)
def gather_rule(call: OpCall, n: int) -> list[Strategy]:
    """``gather(x, dim, index)``: split a non-gather dim of both, or split the gather dim of x
    (masked gather of the local range, Partial)."""
    x, index = call.in_shapes[0], call.in_shapes[1]
    dim = norm_dim(call.node.args[1], len(x))
    res = [Strategy((R, R), R)]
    for d in range(len(x)):
        if d == dim:
            if can_split(x[d], n):
                res.append(Strategy((S(d), R), Part(), lowering=MASKED_GATHER))
        elif can_split(index[d], n) and can_split(x[d], n) and str(x[d]) == str(index[d]):
            res.append(Strategy((S(d), S(d)), S(d)))
    return res


@register(aten.index_put.default)
def index_put_rule(call: OpCall, n: int) -> list[Strategy]:
    """``index_put(self, [idx], values, accumulate)`` (the embedding backward): split a non-indexed
    trailing dim; split the indexed dim 0 with a masked local write (accumulate only); or Partial
    in (self, values) when accumulating."""
    k = len(call.in_shapes)
    indices = call.node.args[1]
    accumulate = call.node.args[3] if len(call.node.args) > 3 else call.node.kwargs.get("accumulate", False)
    masks = [i.meta["val"].dim() for i in indices
             if isinstance(i, fx.Node) and i.meta["val"].dtype in (torch.bool, torch.uint8)]
    n_idx = len(indices) - len(masks) + sum(masks)  # a boolean mask indexes as many dims as it has
    n_tensor_idx = k - 2
    self_shape, values_shape = call.in_shapes[0], call.in_shapes[-1]
    idx_r = (R,) * n_tensor_idx
    res = [Strategy((R,) * k, R)]
    for d in range(n_idx, len(self_shape)):
        if can_split(self_shape[d], n):
            j = len(values_shape) - (len(self_shape) - d)  # values broadcast into self's trailing dims
            broadcast = j < 0 or (equal(values_shape[j], 1) and not equal(self_shape[d], 1))
            res.append(Strategy((S(d),) + idx_r + (R if broadcast else S(j),), S(d)))
    if accumulate:
        res.append(Strategy((Part(),) + idx_r + (Part(),), Part()))
        # the masked write zeroes the values rows of missed indices: values must have a row per index
        full = n_tensor_idx == 1 and len(values_shape) == len(call.in_shapes[1]) + len(self_shape) - 1 and all(
            equal(a, b) for a, b in zip(values_shape, tuple(call.in_shapes[1]) + tuple(self_shape[1:])))
        if n_idx == 1 and not masks and full and can_split(self_shape[0], n):
            res.append(Strategy((S(0),) + idx_r + (R,), S(0), lowering=MASKED_INDEX_PUT))
    return res


@register(aten.scatter_add.default)
def scatter_add_rule(call: OpCall, n: int) -> list[Strategy]:
    """``scatter_add(self, dim, index, src)`` (the gather backward): split a non-scatter dim of all
    three, split the scatter dim of self (masked local scatter), or Partial in (self, src)."""
    x, index, src = call.in_shapes
    dim = norm_dim(call.node.args[1], len(x))
    res = [Strategy((R, R, R), R), Strategy((Part(), R, Part()), Part())]
    for d in range(len(x)):
        if d == dim:
            if can_split(x[d], n):
                res.append(Strategy((S(d), R, R), S(d), lowering=MASKED_SCATTER_ADD))
        elif can_split(x[d], n) and str(x[d]) == str(index[d]) == str(src[d]):
            res.append(Strategy((S(d), S(d), S(d)), S(d)))
    return res


def _max_indices(shape) -> object:
    """``max`` mode's per-feature argmax indices ``[bags, D]`` follow a split of D; other modes' are 1-D."""
    return S(1) if len(shape) == 2 else R


@register(aten._embedding_bag.default)
def embedding_bag_rule(call: OpCall, n: int) -> list[Strategy]:
    """``_embedding_bag(weight[V, D], indices, offsets, ..., per_sample_weights?, ...) -> (out[bags, D],
    offset2bag, bag_size, max_indices)``: each feature column is pooled on its own, so D splits."""
    k = len(call.in_shapes)
    outs = call.out_shape
    res = [Strategy((R,) * k, (R,) * len(outs))]
    if can_split(call.in_shapes[0][1], n):
        res.append(Strategy((S(1),) + (R,) * (k - 1), (S(1), R, R, _max_indices(outs[3]))))
    return res


@register(aten._embedding_bag_backward.default)
def embedding_bag_backward_rule(call: OpCall, n: int) -> list[Strategy]:
    """``_embedding_bag_backward(grad[bags, D], indices, offsets, offset2bag, bag_size, max_indices,
    num_weights, ...) -> [V, D]``: the forward's split of D."""
    k = len(call.in_shapes)
    res = [Strategy((R,) * k, R)]
    if can_split(call.in_shapes[0][1], n):
        res.append(Strategy((S(1),) + (R,) * 4 + (_max_indices(call.in_shapes[5]),) + (R,) * (k - 6), S(1)))
    return res


@register(aten._embedding_bag_per_sample_weights_backward.default)
def embedding_bag_weights_backward_rule(call: OpCall, n: int) -> list[Strategy]:
    """``(grad[bags, D], weight[V, D], indices, offsets, offset2bag, mode, padding_idx) -> [indices]``: a
    sum over D, so split D gives this rank's terms."""
    k = len(call.in_shapes)
    res = [Strategy((R,) * k, R)]
    if can_split(call.in_shapes[0][1], n):
        res.append(Strategy((S(1), S(1)) + (R,) * (k - 2), Part()))
    return res
