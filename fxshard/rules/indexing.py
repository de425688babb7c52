"""Indexing with index tensors, and writing slices back: a dim the op does not index may be split.

``index``/``index_select`` pick elements: any Partial input stays Partial, a split of a dim that is
not indexed carries over to the output, and splitting the index tensors along their (broadcast)
shape splits the output there. The ``*_scatter`` ops write a slice, a row or a diagonal of ``src``
into ``x``: every other dim of both may be split alike, and each element of the result is either
``x``'s or ``src``'s, so Partial inputs of one kind stay Partial. ``scatter`` with an index tensor
may be split along any dim but the scattered one where ``x``, ``index`` and ``src`` have equal
sizes. Index-dependent splits of the indexed dim (a masked local lookup, as for embeddings in
``embedding.py``) are not offered: such inputs are gathered.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..core.placements import Part, Pl, R, S
from .registry import OpCall, Strategy, norm_dim, register
from ..core.spec import can_split
from ..core.symbolic import Dim, equal

aten = torch.ops.aten

ANY = ("sum", "max", "min")


def _partials(values: Sequence[bool]) -> list[Strategy]:
    """``P(op)`` in the value inputs (``values[i]``), the others replicated, give ``P(op)``."""
    return [Strategy(tuple(Part(op) if v else R for v in values), Part(op)) for op in ANY]


@register(aten.index_select.default)
def index_select_rule(call: OpCall, n: int) -> list[Strategy]:
    """``index_select(x, dim, index[k])``: split another dim of x, or the index (the output's ``dim``)."""
    x, idx = call.in_shapes
    dim = norm_dim(call.arg(1, "dim"), max(len(x), 1))
    res = [Strategy((R, R), R)] + _partials([True, False])
    for d, size in enumerate(x):
        if d != dim and can_split(size, n):
            res.append(Strategy((S(d), R), S(d)))
    if len(idx) == 1 and len(x) > 0 and can_split(idx[0], n):
        res.append(Strategy((R, S(0)), S(dim)))
    return res


def _index_layout(x: Sequence[Dim], indices: Sequence, out: Sequence[Dim]) -> tuple[list[int], int, int]:
    """(indexed dims of x, number of broadcast index dims, where they sit in the output)."""
    pos = [i for i, t in enumerate(indices) if t is not None]
    b = len(out) - (len(x) - len(pos))
    contiguous = pos == list(range(pos[0], pos[-1] + 1))
    return pos, b, (pos[0] if contiguous else 0)


@register(aten.index.Tensor)
def index_rule(call: OpCall, n: int) -> list[Strategy]:
    """``x[indices]`` (advanced indexing; None entries keep a dim whole): split a dim that is not indexed,
    or split every index tensor along one broadcast dim (size-1 and missing dims replicated)."""
    x, out, k = call.in_shapes[0], call.out_shape, len(call.in_shapes)
    res = [Strategy((R,) * k, R)]
    if any(dt in (torch.bool, torch.uint8) for dt in call.in_dtypes[1:]):
        return res  # a mask indexes several dims, data-dependently
    res += _partials([True] + [False] * (k - 1))
    pos, b, first = _index_layout(x, call.node.args[1], out)
    kept = [d for d in range(len(x)) if d not in pos]
    for d in kept:
        if can_split(x[d], n):
            o = d if d < first else first + b + kept.index(d) - sum(1 for e in kept if e < first)
            res.append(Strategy((S(d),) + (R,) * (k - 1), S(o)))
    for j in range(b):
        if not can_split(out[first + j], n):
            continue
        pls: list[Pl] = [R]
        for shape in call.in_shapes[1:]:
            i = j - (b - len(shape))
            pls.append(R if i < 0 or equal(shape[i], 1) else S(i))
        res.append(Strategy(tuple(pls), S(first + j)))
    return res


def _scatter_like(call: OpCall, n: int, dims_of_src, k: int) -> list[Strategy]:
    """R; ANY Partial in x and src; x split on a dim the op leaves alone, src split where
    ``dims_of_src(d)`` says (None: that dim of x cannot be split)."""
    res = [Strategy((R,) * k, R)] + _partials([True] * k)
    for d, size in enumerate(call.in_shapes[0]):
        j = dims_of_src(d)
        if j is not None and can_split(size, n):
            res.append(Strategy((S(d), S(j)), S(d)))
    return res


@register(aten.slice_scatter.default)
def slice_scatter_rule(call: OpCall, n: int) -> list[Strategy]:
    """``slice_scatter(x, src, dim, start, end, step)``: ``src`` is x's shape but for ``dim``."""
    dim = norm_dim(call.arg(2, "dim", 0), len(call.in_shapes[0]))
    return _scatter_like(call, n, lambda d: d if d != dim else None, 2)


@register(aten.select_scatter.default)
def select_scatter_rule(call: OpCall, n: int) -> list[Strategy]:
    """``select_scatter(x, src, dim, index)``: ``src`` lacks ``dim``."""
    dim = norm_dim(call.arg(2, "dim"), len(call.in_shapes[0]))
    return _scatter_like(call, n, lambda d: None if d == dim else d - (d > dim), 2)


@register(aten.diagonal_scatter.default)
def diagonal_scatter_rule(call: OpCall, n: int) -> list[Strategy]:
    """``diagonal_scatter(x, src, offset, dim1, dim2)``: ``src`` is the diagonal (other dims, then it)."""
    ndim = len(call.in_shapes[0])
    d1, d2 = norm_dim(call.arg(3, "dim1", 0), ndim), norm_dim(call.arg(4, "dim2", 1), ndim)
    rest = [d for d in range(ndim) if d not in (d1, d2)]
    return _scatter_like(call, n, lambda d: rest.index(d) if d in rest else None, 2)


@register([aten.scatter.src, aten.scatter.value, aten.scatter_reduce.two])
def scatter_rule(call: OpCall, n: int) -> list[Strategy]:
    """``scatter(x, dim, index, src|value)`` / ``scatter_reduce(x, dim, index, src, reduce)``: split a
    dim other than ``dim`` where every tensor input has x's size."""
    shapes = call.in_shapes
    x = shapes[0]
    dim = norm_dim(call.arg(1, "dim"), max(len(x), 1))
    res = [Strategy((R,) * len(shapes), R)]
    for d, size in enumerate(x):
        if d != dim and can_split(size, n) and all(len(s) == len(x) and equal(s[d], size) for s in shapes):
            res.append(Strategy((S(d),) * len(shapes), S(d)))
    return res
