"""Emit the graph nodes that turn one placement into another on the local tensors.

Every emitted program is plain ATen plus ``torch.ops._c10d_functional``
collectives and ``wait_tensor``, so it runs eagerly, exports and compiles. The
functional gather/scatter act on dim 0; other dims (and strided shards) are
permuted to the front around them. Symbolic sizes become ``sym_size`` nodes.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Sequence, Union

import torch
import torch.fx as fx

from ..core.ir import COMM_KEY, INSERTED_KEY
from ..core.mesh import MeshInfo
from ..core.placements import Pl, S
from ..core.spec import Spec, chunk, is_uneven
from ..core.symbolic import Dim, ceil_div, is_concrete
from .transition import Step, hint, plan_transition

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

__all__ = ["Emitter", "COMM_KEY", "INSERTED_KEY", "redistribute_nodes", "hint", "all_reduce_into_input"]


Val = Union[int, fx.Node]


@dataclass
class Emitter:
    """Creates nodes before ``anchor`` in ``graph``, tagging each as fxshard-inserted."""

    graph: fx.Graph
    anchor: fx.Node
    reason: dict

    def op(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            n = self.graph.call_function(target, args, kwargs)
        n.meta[INSERTED_KEY] = True
        return n

    def size(self, x: fx.Node, d: int, ld: Dim) -> Val:
        return int(ld) if is_concrete(ld) else self.op(aten.sym_size.int, x, d)

    def arith(self, fn: Any, a: Val, b: Val) -> Val:
        if isinstance(a, int) and isinstance(b, int):
            return fn(a, b)
        return self.op(fn, a, b)

    def shape(self, x: fx.Node, lshape: Sequence[Dim]) -> list[Val]:
        return [self.size(x, d, s) for d, s in enumerate(lshape)]

    def contiguous(self, x: fx.Node) -> fx.Node:
        return self.op(aten.clone.default, x, memory_format=torch.contiguous_format)

    def comm(self, target: Any, kind: str, axis: str, x: fx.Node, nbytes: int, *args: Any,
             shape: Any = None) -> fx.Node:
        """The collective ``target(x, *args)`` and its wait; ``shape`` (``x``'s local shape), when given,
        is recorded for passes that repack collectives (``passes/bucket.py``)."""
        c = self.op(target, x, *args)
        c.meta[COMM_KEY] = dict(self.reason, kind=kind, axis=axis, bytes=nbytes)
        if shape is not None:
            c.meta[COMM_KEY]["shape"] = tuple(shape)
        w = self.op(c10d.wait_tensor.default, c)
        return w


def _to_front(e: Emitter, x: fx.Node, d: int, ndim: int, contiguous: bool) -> tuple[fx.Node, list[int]]:
    """``x`` with dim ``d`` moved to the front, contiguous (no copy when already so)."""
    perm = [d] + [i for i in range(ndim) if i != d]
    if d == 0:
        return (x if contiguous else e.contiguous(x)), perm
    return e.contiguous(e.op(aten.permute.default, x, perm)), perm


def _inverse(perm: list[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def _pad_front(e: Emitter, x: fx.Node, ndim: int, by: int) -> fx.Node:
    """``x`` with ``by`` zero rows appended to dim 0 (collectives need equal pieces on every rank)."""
    return e.op(aten.constant_pad_nd.default, x, [0, 0] * (ndim - 1) + [0, by], 0.0) if by else x


def all_gather(e: Emitter, x: fx.Node, st: Step, mesh: MeshInfo, contiguous: bool) -> fx.Node:
    """Gather split ``st.src`` on axis ``st.axis``; ``st.gsize`` is the dim's size after the gather.

    An uneven split (``torch.chunk`` pieces) is padded to the largest piece, gathered, and cut to ``gsize``.
    """
    p, a, lshape, gsize = st.src, st.axis, st.lshape, st.gsize
    n = mesh.sizes[a]
    ndim = len(lshape)
    uneven = is_uneven(gsize, n)
    piece = ceil_div(int(gsize), n) if uneven else lshape[p.dim]
    if p.dim != 0 and p.outer == 1 and not uneven:
        # gather the pieces as they are ([n * d0, ...]) and interleave them into dim p.dim with one copy
        src = x if contiguous else e.contiguous(x)
        g = e.comm(c10d.all_gather_into_tensor.default, "all_gather", mesh.names[a], src, st.nbytes, n,
                   mesh.group_names[a])
        dims = e.shape(src, lshape)
        g = e.op(aten.view.default, g, [n] + dims)
        order = list(range(1, p.dim + 1)) + [0] + list(range(p.dim + 1, ndim + 1))
        g = e.contiguous(e.op(aten.permute.default, g, order))
        return e.op(aten.view.default, g, [e.arith(operator.mul, d, n) if i == p.dim else d for i, d in enumerate(dims)])
    xf, perm = _to_front(e, x, p.dim, ndim, contiguous)
    if uneven:
        xf = _pad_front(e, xf, ndim, piece - int(lshape[p.dim]))
    g = e.comm(c10d.all_gather_into_tensor.default, "all_gather", mesh.names[a], xf, st.nbytes, n,
               mesh.group_names[a])
    if uneven:
        g = e.op(aten.slice.Tensor, g, 0, 0, int(gsize))
    rest = [e.size(xf, i, lshape[perm[i]]) for i in range(1, ndim)]
    ld = e.size(xf, 0, lshape[p.dim])
    if p.outer > 1:
        m = e.arith(operator.floordiv, ld, p.outer)
        g = e.op(aten.view.default, g, [n, p.outer, m] + rest)
        g = e.contiguous(e.op(aten.permute.default, g, [1, 0, 2] + list(range(3, 3 + len(rest)))))
        g = e.op(aten.view.default, g, [e.arith(operator.mul, ld, n)] + rest)
    return e.contiguous(e.op(aten.permute.default, g, _inverse(perm))) if p.dim != 0 else g


def _rs_front(e: Emitter, x: fx.Node, lshape: Sequence[Dim], p: S, n: int, contiguous: bool
              ) -> tuple[fx.Node, list[int]]:
    """Permute ``x`` so dim 0 holds rank-major chunks of the (strided) split dim."""
    ndim = len(lshape)
    xf, perm = _to_front(e, x, p.dim, ndim, contiguous)
    if p.outer > 1:
        rest = [e.size(xf, i, lshape[perm[i]]) for i in range(1, ndim)]
        ld = e.size(xf, 0, lshape[p.dim])
        m = e.arith(operator.floordiv, ld, p.outer * n)
        xf = e.op(aten.view.default, xf, [p.outer, n, m] + rest)
        xf = e.contiguous(e.op(aten.permute.default, xf, [1, 0, 2] + list(range(3, 3 + len(rest)))))
        xf = e.op(aten.view.default, xf, [ld] + rest)
    return xf, perm


def reduce_scatter(e: Emitter, x: fx.Node, st: Step, mesh: MeshInfo, contiguous: bool) -> fx.Node:
    p, a, lshape = st.dst, st.axis, st.lshape
    n = mesh.sizes[a]
    size = lshape[p.dim]
    uneven = is_uneven(size, n)
    if p.dim != 0 and p.outer == 1 and not uneven:
        # rank-major chunks of dim p.dim to the front ([n, ..., size / n, ...], one copy); the result
        # [1, ..., size / n, ...] is this rank's piece as a view
        dims = e.shape(x, lshape)
        chunk_ = e.arith(operator.floordiv, dims[p.dim], n)
        v = e.op(aten.view.default, x if contiguous else e.contiguous(x), dims[: p.dim] + [n, chunk_] + dims[p.dim + 1:])
        order = [p.dim] + [i for i in range(len(lshape) + 1) if i != p.dim]
        front = e.contiguous(e.op(aten.permute.default, v, order))
        shape = [n] + [lshape[i] if i != p.dim else size // n for i in range(len(lshape))]
        r = e.comm(c10d.reduce_scatter_tensor.default, "reduce_scatter", mesh.names[a], front, st.nbytes, "sum", n,
                   mesh.group_names[a], shape=shape)
        return e.op(aten.view.default, r, dims[: p.dim] + [chunk_] + dims[p.dim + 1:])
    xf, perm = _rs_front(e, x, lshape, p, n, contiguous)
    if uneven:  # pad to n equal pieces; this rank keeps its torch.chunk piece of the reduced result
        piece = ceil_div(int(size), n)
        xf = _pad_front(e, xf, len(lshape), piece * n - int(size))
    front = [lshape[perm[0]] if not uneven else ceil_div(int(size), n) * n] + [lshape[i] for i in perm[1:]]
    r = e.comm(c10d.reduce_scatter_tensor.default, "reduce_scatter", mesh.names[a], xf, st.nbytes, "sum", n,
               mesh.group_names[a], shape=front)
    if uneven:
        r = e.op(aten.slice.Tensor, r, 0, 0, chunk(int(size), n, mesh.coords[a])[1])
    return e.contiguous(e.op(aten.permute.default, r, _inverse(perm))) if p.dim != 0 else r


def all_reduce_into_input(x: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    """``_c10d_functional.all_reduce(x, ...)``, reducing ``x`` itself (and returning it) when running eagerly
    on a plain contiguous tensor; traced (``torch.compile``, ``make_fx``), the functional all_reduce
    (functionalization cannot take an op whose output aliases its input). Requires that nothing reads
    ``x`` afterwards except through the result (``passes/inplace.py``).

    The pass picks inputs whose traced value is contiguous; ``x`` is checked again here because gloo's
    ``all_reduce_`` does not: it reduces ``numel`` elements from ``x``'s first one, which for a slice
    reduces its neighbours and for an expanded tensor writes past its storage."""
    if type(x) is torch.Tensor and x.is_contiguous() and not torch.compiler.is_compiling():
        return c10d.all_reduce_(x, reduce_op, group_name)
    return c10d.all_reduce(x, reduce_op, group_name)


def all_reduce(e: Emitter, x: fx.Node, st: Step, mesh: MeshInfo, contiguous: bool) -> fx.Node:
    src = x if contiguous else e.contiguous(x)
    return e.comm(c10d.all_reduce.default, "all_reduce", mesh.names[st.axis], src, st.nbytes, st.src.op,
                  mesh.group_names[st.axis], shape=st.lshape)


def local_slice(e: Emitter, x: fx.Node, st: Step, mesh: MeshInfo, contiguous: bool) -> fx.Node:
    """This rank's piece of ``x`` (whole on axis ``a``) split as ``p``: a copy when the piece is not
    contiguous (a split dim other than 0), since kernels such as ``native_layer_norm_backward`` read
    their saved statistics as contiguous and views need the strides they were traced with."""
    p, a, lshape = st.dst, st.axis, st.lshape
    n = mesh.sizes[a]
    c = mesh.coords[a]
    if is_uneven(lshape[p.dim], n):
        start, length = chunk(int(lshape[p.dim]), n, c)
        return _dense(e, e.op(aten.slice.Tensor, x, p.dim, start, start + length), p.dim)
    ld = e.size(x, p.dim, lshape[p.dim])
    if p.outer == 1:
        piece = e.arith(operator.floordiv, ld, n)
        return _dense(e, e.op(aten.slice.Tensor, x, p.dim, e.arith(operator.mul, piece, c),
                              e.arith(operator.mul, piece, c + 1)), p.dim)
    dims = [e.size(x, i, s) for i, s in enumerate(lshape)]
    m = e.arith(operator.floordiv, ld, p.outer * n)
    v = e.op(aten.view.default, e.contiguous(x), dims[: p.dim] + [p.outer, e.arith(operator.mul, m, n)] + dims[p.dim + 1:])
    s = e.contiguous(e.op(aten.slice.Tensor, v, p.dim + 1, e.arith(operator.mul, m, c), e.arith(operator.mul, m, c + 1)))
    return e.op(aten.view.default, s, dims[: p.dim] + [e.arith(operator.mul, m, p.outer)] + dims[p.dim + 1:])


def _dense(e: Emitter, piece: fx.Node, dim: int) -> fx.Node:
    return piece if dim == 0 else e.contiguous(piece)


def all_to_all(e: Emitter, x: fx.Node, st: Step, mesh: MeshInfo, contiguous: bool) -> fx.Node:
    """S(src.dim) -> S(dst.dim) on axis ``a``: each rank keeps 1/n of what a gather would move.

    Requires concrete sizes and plain (non-strided) shards on different dims.
    """
    a = st.axis
    n = mesh.sizes[a]
    sd, dd = st.src.dim, st.dst.dim
    shape = [int(s) for s in st.lshape]
    nb = shape[dd] // n
    x = x if contiguous else e.contiguous(x)
    v = e.op(aten.view.default, x, shape[:dd] + [n, nb] + shape[dd + 1:])
    perm = [dd] + [i for i in range(len(shape) + 1) if i != dd]
    front = e.contiguous(e.op(aten.permute.default, v, perm))
    y = e.comm(c10d.all_to_all_single.default, "all_to_all", mesh.names[a], front, st.nbytes, [1] * n, [1] * n,
               mesh.group_names[a])
    rest = shape[:dd] + [nb] + shape[dd + 1:]
    order = list(range(1, sd + 1)) + [0] + list(range(sd + 1, len(rest) + 1))
    merged = e.contiguous(e.op(aten.permute.default, y, order))
    out = rest[:sd] + [rest[sd] * n] + rest[sd + 1:]
    return e.op(aten.view.default, merged, out)


def to_partial(e: Emitter, x: fx.Node, st: Step, mesh: MeshInfo, contiguous: bool) -> fx.Node:
    if st.dst.op == "sum" and mesh.coords[st.axis] != 0:
        return e.op(aten.zeros_like.default, x)
    return x


def _cast(e: Emitter, x: fx.Node, st: Step, mesh: MeshInfo, contiguous: bool) -> fx.Node:
    return e.op(aten._to_copy.default, x, dtype=st.dtype, memory_format=torch.contiguous_format)


# step kind -> (emitter, whether its result is contiguous); a local step keeps the input's layout flag
EMITTERS = {
    "all_reduce": (all_reduce, True), "reduce_scatter": (reduce_scatter, True), "all_gather": (all_gather, True),
    "all_to_all": (all_to_all, True), "slice": (local_slice, True), "to_partial": (to_partial, None),
    "cast": (_cast, True),
}


def redistribute_nodes(e: Emitter, x: fx.Node, spec: Spec, dst: Sequence[Pl], mesh: MeshInfo) -> fx.Node:
    """Nodes computing ``x`` (local, laid out per ``spec``) laid out per ``dst``: the steps of
    ``transition.plan_transition``, emitted in order (each collective records the step's bytes)."""
    contiguous = True
    val = x.meta.get("val")
    if isinstance(val, torch.Tensor) and not x.meta.get(INSERTED_KEY):
        contiguous = val.is_contiguous()
    for st in plan_transition(spec.placements, dst, spec.shape, mesh, spec.dtype):
        emit, dense = EMITTERS[st.kind]
        x = emit(e, x, st, mesh, contiguous)
        contiguous = contiguous if dense is None else dense
    return x
