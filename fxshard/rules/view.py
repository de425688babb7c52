"""Views and data movement: one algebra mapping input dims to output dims.

``view``/``reshape`` group input and output dims whose size products match;
a split input dim survives the view when the contiguous chunk it describes is
again a (possibly strided) chunk of one output dim. That is how heads split
through ``view(B, T, H, hd)`` and through the ``[B*H, ...]`` merges of
attention. Every other op here is a fixed dim permutation/insertion/removal.
Partial values pass through all of them unchanged.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..core.errors import ShardingError
from ..core.ir import source_line
from ..core.placements import Part, Pl, R, S
from .registry import OpCall, Strategy, norm_dim, norm_dims, outer_of, register
from ..core.spec import can_split
from ..core.symbolic import Dim, divides, equal, exact_div, is_concrete, prod
from .pointwise import dim_map

aten = torch.ops.aten

Group = tuple[list[int], list[int]]


def view_groups(in_shape: Sequence[Dim], out_shape: Sequence[Dim]) -> list[Group]:
    """Pair runs of input dims with runs of output dims of equal size product.

    Requires ``prod(in_shape) == prod(out_shape)``; ensures the groups cover
    every dim of both shapes in order (size-1 dims may form groups alone).
    """
    groups: list[Group] = []
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        gi: list[int] = []
        go: list[int] = []
        pin: Dim = 1
        pout: Dim = 1
        if i < len(in_shape):
            gi.append(i)
            pin = in_shape[i]
            i += 1
        if j < len(out_shape):
            go.append(j)
            pout = out_shape[j]
            j += 1
        while not equal(pin, pout):
            grow_in = i < len(in_shape) and (divides(pout, pin) or j >= len(out_shape))
            if grow_in:
                gi.append(i)
                pin = pin * in_shape[i]
                i += 1
            elif j < len(out_shape):
                go.append(j)
                pout = pout * out_shape[j]
                j += 1
            else:
                break
        groups.append((gi, go))
    return groups


def _lt(a: Dim, b: Dim) -> bool:
    if is_concrete(a) and is_concrete(b):
        return int(a) < int(b)
    return not divides(a, b)  # symbolic: a multiple of b is never smaller


def view_shard(in_shape: Sequence[Dim], out_shape: Sequence[Dim], p: S, n: int) -> Optional[S]:
    """Where a split ``p`` of the input lands in the output, or None if it cannot be expressed."""
    for gi, go in view_groups(in_shape, out_shape):
        if p.dim not in gi:
            continue
        size = in_shape[p.dim]
        if not divides(size, p.outer * n):  # uneven: only a dim the view leaves as it is keeps its split
            ins = [d for d in gi if not equal(in_shape[d], 1)]  # size-1 dims come and go freely
            outs = [j for j in go if not equal(out_shape[j], 1)]
            same = ins == [p.dim] and len(outs) == 1 and equal(size, out_shape[outs[0]])
            return S(outs[0]) if same and can_split(size, n, p.outer) else None
        pre = p.outer * prod(in_shape[d] for d in gi[: gi.index(p.dim)])
        sz = exact_div(size, p.outer)
        acc: Dim = 1
        for jd in go:
            osz = out_shape[jd]
            if equal(osz, 1) or not divides(pre, acc) or not _lt(pre, acc * osz):
                acc = acc * osz
                continue
            a = exact_div(pre, acc)
            if divides(osz, a * sz):
                return S(jd, int(a)) if is_concrete(a) else None
            if equal(a, 1) and divides(sz, osz) and divides(osz, n):
                return S(jd, 1)
            return None
        return None
    return None


def reject_group_cut(call: OpCall, n: int) -> None:
    """Raise a ShardingError when a view splits an input dim that arrives split over ``n`` ranks into
    groups whose count (the leading factor, e.g. attention heads) ``n`` does not divide: each rank
    would hold a fraction of a group, so the only correct plan gathers the whole tensor first, which
    silently undoes the user's split. The user fixes the plan or the sizes instead."""
    p = call.in_pls[0]
    if not isinstance(p, S) or n == 1:
        return
    in_shape, out_shape = call.in_shapes[0], call.out_shape
    for gi, go in view_groups(in_shape, out_shape):
        factors = [out_shape[j] for j in go if not equal(out_shape[j], 1)]
        if gi != [p.dim] or len(factors) < 2 or view_shard(in_shape, out_shape, p, n) is not None:
            continue
        if divides(factors[0], p.outer * n):
            return
        line = source_line(call.node)
        where = line or f"{call.node.name} (no line of the model: a reshape its gradient or a decomposition makes)"
        keep = ("e.g. ColwiseParallel(output_layouts=Replicate()) on the projection that produces it, or no plan "
                "entry for it" if line else
                f"in_specs, out_specs or constraints that do not split dim {p.dim} of the value reshaped there")
        raise ShardingError(
            f"{where}: this view reshapes dim {p.dim} (size {in_shape[p.dim]}, split over a mesh axis of {n} "
            f"ranks) into {list(factors)}, and {n} does not divide the {factors[0]} groups (e.g. attention "
            f"heads), so a rank would hold part of a group. Use a group/head count divisible by {n} or a "
            f"smaller mesh axis, or keep the tensor whole here ({keep})"
        )


def _mapped_rule(mapper: Callable[[OpCall, S, int], Optional[S]]):
    """A rule for ops that move one input's dims: R->R, P->P, and each split the mapper accepts."""

    def rule(call: OpCall, n: int) -> list[Strategy]:
        if mapper is _view:
            reject_group_cut(call, n)
        k = len(call.in_shapes)
        rest = (R,) * (k - 1)
        res = [Strategy((R,) + rest, R)]
        pad_value = call.node.args[2] if call.node.target is aten.constant_pad_nd.default and len(call.node.args) > 2 else 0
        val = call.node.meta.get("val")
        complex_ = any(dt.is_complex for dt in call.in_dtypes) or (isinstance(val, torch.Tensor) and val.is_complex())
        for op in (("sum",) if complex_ else ("sum", "max", "min")) if pad_value == 0 else ():
            res.append(Strategy((Part(op),) + rest, _multi(call, Part(op))))
        cur = call.in_pls[0]
        for d, size in enumerate(call.in_shapes[0]):
            o = outer_of(cur, d)
            if not can_split(size, n, o):
                continue
            out = mapper(call, S(d, o), n)
            if out is not None:
                res.append(Strategy((S(d, o),) + rest, _multi(call, out)))
        return res

    rule.__name__ = mapper.__name__.lstrip("_") + "_rule"
    return rule


def _multi(call: OpCall, pl: Pl):
    """Same placement for every output of a multi-output op (split, unbind)."""
    out = call.out_shape
    if out and isinstance(out[0], tuple):
        return tuple(pl for _ in out)
    return pl


def _view(call: OpCall, p: S, n: int) -> Optional[S]:
    return view_shard(call.in_shapes[0], call.out_shape, p, n)


def _expand(call: OpCall, p: S, n: int) -> Optional[S]:
    m = dim_map(call.in_shapes[0], call.out_shape)
    return S(m.index(p.dim), p.outer) if p.dim in m else None


def _permute(call: OpCall, p: S, n: int) -> Optional[S]:
    t = call.node.target
    ndim = len(call.in_shapes[0])
    if t is aten.permute.default:
        perm = [norm_dim(d, ndim) for d in call.node.args[1]]
        return S(perm.index(p.dim), p.outer)
    if t is aten.t.default:
        return S(1 - p.dim, p.outer) if ndim == 2 else p
    a, b = (norm_dim(d, ndim) for d in call.node.args[1:3])
    return S(b if p.dim == a else a if p.dim == b else p.dim, p.outer)


def _unsqueeze(call: OpCall, p: S, n: int) -> Optional[S]:
    d = norm_dim(call.node.args[1], len(call.in_shapes[0]) + 1)
    return S(p.dim + (1 if p.dim >= d else 0), p.outer)


def _squeeze(call: OpCall, p: S, n: int) -> Optional[S]:
    shape = call.in_shapes[0]
    ndim = len(shape)
    t = call.node.target
    if t is aten.squeeze.default:
        dims = [d for d in range(ndim) if equal(shape[d], 1)]
    else:
        dims = [d for d in norm_dims(call.node.args[1], ndim) if equal(shape[d], 1)]
    if p.dim in dims:
        return None
    return S(p.dim - sum(1 for d in dims if d < p.dim), p.outer)


def _slice(call: OpCall, p: S, n: int) -> Optional[S]:
    shape = call.in_shapes[0]
    a = call.node.args
    dim = norm_dim(a[1] if len(a) > 1 else 0, len(shape))
    if p.dim != dim:
        return p
    start = a[2] if len(a) > 2 else 0
    end = a[3] if len(a) > 3 else None
    step = a[4] if len(a) > 4 else 1
    full_end = end is None or (isinstance(end, int) and is_concrete(shape[dim]) and end >= int(shape[dim]))
    if start in (0, None) and step == 1 and (full_end or (end is not None and equal(end, shape[dim]))):
        return p
    return None


def _select(call: OpCall, p: S, n: int) -> Optional[S]:
    dim = norm_dim(call.node.args[1], len(call.in_shapes[0]))
    if p.dim == dim:
        return None
    return S(p.dim - (1 if p.dim > dim else 0), p.outer)


def _split(call: OpCall, p: S, n: int) -> Optional[S]:
    """Splitting another dim keeps ``p``; splitting a packed dim into equal parts of whole blocks (a fused
    ``[gate; up]`` cut in two) leaves each part packed with fewer blocks, every rank keeping its chunks."""
    a = call.node.args
    dim = norm_dim(a[2] if len(a) > 2 else call.node.kwargs.get("dim", 0), len(call.in_shapes[0]))
    if p.dim != dim:
        return p
    parts = [s[dim] for s in call.out_shape]
    if p.outer % len(parts) == 0 and all(equal(s, parts[0]) for s in parts):
        return S(dim, p.outer // len(parts))
    return None


def _unbind(call: OpCall, p: S, n: int) -> Optional[S]:
    a = call.node.args
    dim = norm_dim(a[1] if len(a) > 1 else 0, len(call.in_shapes[0]))
    return None if p.dim == dim else S(p.dim - (1 if p.dim > dim else 0), p.outer)


def _pad(call: OpCall, p: S, n: int) -> Optional[S]:
    npad = len(call.node.args[1]) // 2
    return None if p.dim >= len(call.in_shapes[0]) - npad else p


def _diagonal(call: OpCall, p: S, n: int) -> Optional[S]:
    """``diagonal(x, offset, dim1, dim2)``: the other dims keep their order, the diagonal goes last."""
    ndim = len(call.in_shapes[0])
    d1, d2 = (norm_dim(call.arg(i, k, dflt), ndim) for i, k, dflt in ((2, "dim1", 0), (3, "dim2", 1)))
    rest = [d for d in range(ndim) if d not in (d1, d2)]
    return S(rest.index(p.dim), p.outer) if p.dim in rest else None


def _view_as_real(call: OpCall, p: S, n: int) -> Optional[S]:
    return p  # [..., 2] appended


def _view_as_complex(call: OpCall, p: S, n: int) -> Optional[S]:
    return p if p.dim < len(call.in_shapes[0]) - 1 else None  # the trailing [2] goes


def _repeat(call: OpCall, p: S, n: int) -> Optional[S]:
    """``repeat(x, repeats)``: a split dim survives where it is repeated once (leading dims may be added)."""
    repeats = call.node.args[1]
    d = p.dim + len(repeats) - len(call.in_shapes[0])
    return S(d, p.outer) if repeats[d] == 1 else None


VIEW_OPS = {
    _view: [aten.view.default, aten._unsafe_view.default, aten.reshape.default],
    _expand: [aten.expand.default],
    _permute: [aten.permute.default, aten.t.default, aten.transpose.int],
    _unsqueeze: [aten.unsqueeze.default],
    _squeeze: [aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default],
    _slice: [aten.slice.Tensor],
    _select: [aten.select.int],
    _split: [aten.split.Tensor, aten.split_with_sizes.default],
    _unbind: [aten.unbind.int],
    _pad: [aten.constant_pad_nd.default],
    _diagonal: [aten.diagonal.default],
    _view_as_real: [aten.view_as_real.default],
    _view_as_complex: [aten.view_as_complex.default],
    _repeat: [aten.repeat.default],
}
for _mapper, _ops in VIEW_OPS.items():
    register(_ops, _mapped_rule(_mapper))


@register(aten.cat.default)
def cat_rule(call: OpCall, n: int) -> list[Strategy]:
    """Concatenation: inputs split alike on a dim other than the cat dim, or all Partial."""
    k = len(call.in_shapes)
    ndim = len(call.out_shape)
    dim = norm_dim(call.node.args[1] if len(call.node.args) > 1 else call.node.kwargs.get("dim", 0), ndim)
    res = [Strategy((R,) * k, R), Strategy((Part(),) * k, Part())]
    for d in range(ndim):
        if d != dim and can_split(call.out_shape[d], n):
            if all(len(s) == ndim for s in call.in_shapes):
                res.append(Strategy((S(d),) * k, S(d)))
    # equal parts split alike on the cat dim concatenate to a packed dim (each rank's chunks, part by part)
    o = outer_of(call.in_pls[0], dim)
    if all(len(s) == ndim and equal(s[dim], call.in_shapes[0][dim]) for s in call.in_shapes) \
            and can_split(call.in_shapes[0][dim], n, o):
        res.append(Strategy((S(dim, o),) * k, S(dim, o * k)))
    return res
