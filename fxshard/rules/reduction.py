"""Ops that work along some dims and independently along the others, as one table: reductions,
scans, sorts, flips, FFTs.

Each op has a :class:`Reduce` entry: where its dims and ``keepdim`` arguments are, which Partial a
split reduced dim yields (``sum`` for sums, ``max`` for maxima...; ``mean`` yields ``P(sum)`` through
a lowering that divides the local sum by the global count; ``None`` when the reduction has no
Partial form, like ``var`` or ``argmax``: then reduced dims stay whole), which Partial inputs pass
through (those the op is linear or monotone in), and how many outputs it has (``max.dim`` gives
values and indices). A scan (``cumsum``, ``sort``, ``flip``, an FFT) keeps every dim (``unfold`` adds
one at the end) and only needs the dims it works along whole. The other dims may always be split,
evenly or not: each rank works on its own slice. ``binary_cross_entropy`` is here too: a loss per element,
then (unless ``reduction`` is none) summed over every element, or averaged as ``mean`` is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

import torch.fx as fx

from ..core.context import ShardContext
from ..core.ir import META_KEY
from ..comm.lowering import Lowering, follow_with
from ..core.placements import Part, R, S
from .registry import OpCall, Strategy, all_r, norm_dims, register, split_outers, tensor_inputs
from ..core.spec import can_split, is_uneven
from .pointwise import split_strategies

aten = torch.ops.aten


def _mean_as_sum(g: fx.Graph, node: fx.Node, ctx: ShardContext, axes: list[int]) -> None:
    """A mean over a dim split on ``axes``: local mean * local count / global count = this rank's term
    of the ``P(sum)`` result."""
    spec = tensor_inputs(node)[0].meta[META_KEY]
    m = ctx.mesh
    f, ratio = 1, 1.0
    for a in axes:
        p = spec.placements[a]
        if not isinstance(p, S):
            continue
        if is_uneven(spec.shape[p.dim], m.sizes[a]):
            ratio *= int(spec.local_shape(m.sizes, m.coords)[p.dim]) / int(spec.shape[p.dim])
        else:
            f *= m.sizes[a]
    if ratio == 1.0:
        follow_with(g, node, aten.div.Scalar, f)
    else:
        follow_with(g, node, aten.mul.Scalar, ratio / f)


MEAN_AS_SUM = Lowering("mean_as_sum", _mean_as_sum)

ALL = None  # the reduction covers every dim


@dataclass(frozen=True)
class Reduce:
    """How one op reads its arguments and what it admits (see module doc).

    ``dim``: (positional index or None when keyword-only, keyword, default) of the dims argument, or
    ``ALL``; a default of None means every dim. ``keepdim``: (positional index or None, keyword).
    """

    partial: Optional[str] = None
    keep: tuple[str, ...] = ()
    dim: Optional[tuple[Optional[int], str, Any]] = (1, "dim", None)
    keepdim: tuple[Optional[int], str] = (2, "keepdim")
    scan: bool = False
    outs: int = 1
    lowering: Optional[Lowering] = None


ANY = ("sum", "max", "min")
SUM = Reduce("sum", ("sum",))
WITH_INDEX = Reduce(outs=2)  # (values, indices) over one dim


def scan(dim: tuple = (1, "dim", None), keep: tuple[str, ...] = (), outs: int = 1) -> Reduce:
    return Reduce(dim=dim, keepdim=(None, ""), scan=True, keep=keep, outs=outs)


REDUCTIONS: dict[Any, Reduce] = {
    aten.sum.dim_IntList: SUM,
    aten.sum.default: Reduce("sum", ("sum",), dim=ALL),
    aten.mean.dim: Reduce("sum", ("sum",), lowering=MEAN_AS_SUM),
    aten.mean.default: Reduce("sum", ("sum",), dim=ALL, lowering=MEAN_AS_SUM),
    aten.amax.default: Reduce("max", ("max",)),
    aten.amin.default: Reduce("min", ("min",)),
    aten.max.default: Reduce("max", ("max",), dim=ALL),
    aten.min.default: Reduce("min", ("min",), dim=ALL),
    aten.var.correction: Reduce(keepdim=(None, "keepdim")),  # var.correction(x, dim=None, *, correction, keepdim)
    aten.var_mean.correction: Reduce(keepdim=(None, "keepdim"), outs=2),
    aten.var.dim: Reduce(keepdim=(3, "keepdim")),  # var.dim(x, dim, unbiased=True, keepdim=False)
    aten.std.correction: Reduce(keepdim=(None, "keepdim")),
    aten.std_mean.correction: Reduce(keepdim=(None, "keepdim"), outs=2),
    aten.any.dim: Reduce(),
    aten.any.dims: Reduce(),
    aten.any.default: Reduce(dim=ALL),
    aten.argmax.default: Reduce(),
    aten.argmin.default: Reduce(),
    aten.prod.dim_int: Reduce(),
    aten.max.dim: WITH_INDEX,
    aten.min.dim: WITH_INDEX,
    aten.median.dim: WITH_INDEX,
    aten.nanmedian.dim: WITH_INDEX,
    aten.mode.default: Reduce(dim=(1, "dim", -1), outs=2),
    aten.kthvalue.default: Reduce(dim=(2, "dim", -1), keepdim=(3, "keepdim"), outs=2),  # (x, k, dim, keepdim)
    aten.linalg_vector_norm.default: Reduce(dim=(2, "dim", None), keepdim=(3, "keepdim")),  # (x, ord, dim, keepdim)
    aten.cumsum.default: scan(keep=("sum",)),
    aten.cumprod.default: scan(),
    aten.logcumsumexp.default: scan(),
    aten.cummax.default: scan(outs=2),
    aten.cummin.default: scan(outs=2),
    aten.sort.default: scan((1, "dim", -1), outs=2),
    aten.sort.stable: scan((None, "dim", -1), outs=2),  # sort.stable(x, *, stable, dim=-1, descending)
    aten.topk.default: scan((2, "dim", -1), outs=2),  # topk(x, k, dim=-1, largest, sorted)
    aten.flip.default: scan((1, "dims", None), keep=ANY),
    aten.unfold.default: scan((1, "dimension", None), keep=ANY),  # adds the window dim at the end
    aten._fft_r2c.default: scan(keep=("sum",)),
    aten._fft_c2c.default: scan(keep=("sum",)),
    aten._fft_c2r.default: scan(keep=("sum",)),
}

# linalg_vector_norm over a split dim: the orders whose norm is a plain reduction of per-rank norms
_NORM_PARTIAL = {math.inf: "max", -math.inf: "min", 1.0: "sum", 0.0: "sum"}


def reduced_dims(call: OpCall, spec: Reduce) -> tuple[list[int], bool]:
    """(reduced dims, keepdim) read from the node's arguments."""
    ndim = len(call.in_shapes[0])
    if spec.dim is ALL:
        return list(range(ndim)), False
    i, name, default = spec.dim
    dims = call.arg(i, name, default) if i is not None else call.kwargs.get(name, default)
    keep_i, keep_name = spec.keepdim
    keep = spec.scan or bool(call.arg(keep_i, keep_name, False) if keep_i is not None else
                             call.kwargs.get(keep_name, False))
    return norm_dims(dims, ndim), keep


def out_dim(d: int, dims: list[int], keep: bool) -> Optional[int]:
    if d in dims:
        return None if not keep else d
    return d if keep else d - sum(1 for r in dims if r < d)


def _partial_of(call: OpCall, spec: Reduce) -> Optional[str]:
    if call.node.target is aten.linalg_vector_norm.default:
        return _NORM_PARTIAL.get(float(call.arg(1, "ord", 2)))
    return spec.partial


@register(list(REDUCTIONS))
def reduction_rule(call: OpCall, n: int) -> list[Strategy]:
    spec = REDUCTIONS[call.node.target]
    split_partial = _partial_of(call, spec)
    dims, keep = reduced_dims(call, spec)
    rest = (R,) * (len(call.in_shapes) - 1)
    out = (lambda p: (p,) * spec.outs) if spec.outs > 1 else (lambda p: p)
    res = [Strategy((R,) + rest, out(R))]
    cur = call.in_pls[0]
    for d, size in enumerate(call.in_shapes[0]):
        for o in split_outers([(cur, d)]):
            if not can_split(size, n, o):
                continue
            if d not in dims:
                res.append(Strategy((S(d, o),) + rest, out(S(out_dim(d, dims, keep), o))))
            elif not spec.scan and split_partial is not None:
                res.append(Strategy((S(d, o),) + rest, out(Part(split_partial)), spec.lowering))
    for op in spec.keep:
        res.append(Strategy((Part(op),) + rest, out(Part(op))))
    return res


@register(aten.binary_cross_entropy.default)
def elementwise_loss_rule(call: OpCall, n: int) -> list[Strategy]:
    """``binary_cross_entropy(p, target, weight=None, reduction=1)``: a loss per element of ``p`` (``weight``
    broadcasts to it), then none (0), their mean (1) or their sum (2). A dim split in every input stays split
    without a reduction; with one, each rank's term of the result is its ``P(sum)`` (a mean's through
    ``MEAN_AS_SUM``)."""
    k = len(call.in_shapes)
    splits = split_strategies(call, n, call.in_shapes[0], range(k))
    reduction = call.arg(3, "reduction", 1)
    if reduction != 0:
        splits = [Strategy(s.inputs, Part("sum"), MEAN_AS_SUM if reduction == 1 else None) for s in splits]
    return [Strategy(all_r(k), R)] + splits
