"""Gradient bucketing, as DDP does it: few large gradient collectives, issued while the backward runs.

``bucket_gradients`` (the pipeline's ``bucket`` stage, ``bucket_pass``) requires the backward program of a partitioned training graph
(``joint.partition``), whose collectives carry ``COMM_KEY`` with their input's local ``shape``
(``collectives.Emitter.comm``). It ensures:

* a *gradient collective* is an ``all_reduce`` or a ``reduce_scatter`` (FSDP-style specs) whose
  result reaches the program's output only through view/copy ops (``_TAIL``), with a floating
  dtype and a concrete local shape; any other collective is left as it was;
* gradient collectives with the same op, reduction, process group and dtype are taken in the order
  their inputs are computed and packed greedily into buckets of at most ``bucket_bytes`` (a single
  larger gradient is a bucket of its own; ``plan_buckets``);
* each bucket is one collective over its members' inputs, flattened and concatenated (for a
  reduce_scatter, each member's rank-major rows stay rank-major: ``[n, numel/n]`` pieces
  concatenated on dim 1), issued right after its last member's input is computed, so it runs while
  the rest of the backward computes; it is waited at the end of the program, where its result is
  split and viewed back into the members' results. The view/copy ops that prepare a member's input
  (inserted by redistribute) move up to right after the value they prepare;
* bytes moved are unchanged (the bucket's ``bytes`` is the sum of its members'); the number of
  collectives drops. Every bucket records its members (``COMM_KEY["bucket"]``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Hashable, Optional, Sequence

import torch
import torch.fx as fx

from ..core.context import ShardContext
from ..core.ir import COMM_KEY, INSERTED_KEY, META_KEY
from ..core.symbolic import is_concrete
from ..comm.collectives import all_reduce_into_input

__all__ = ["bucket_gradients", "bucket_pass", "plan_buckets", "DEFAULT_BUCKET_MB"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

DEFAULT_BUCKET_MB = 25.0  # torch DDP's bucket_cap_mb

_BUCKETABLE = (c10d.all_reduce.default, all_reduce_into_input, c10d.reduce_scatter_tensor.default)
# an in-place all_reduce (``passes/inplace.py``) buckets with the out-of-place ones: its bucket is a new buffer
_OUT_OF_PLACE = {all_reduce_into_input: c10d.all_reduce.default}
_TAIL = {aten.view.default, aten._unsafe_view.default, aten.permute.default, aten.clone.default, aten.slice.Tensor,
         aten.t.default, aten.transpose.int, aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default,
         aten._to_copy.default, aten.alias.default}


def plan_buckets(items: Sequence[tuple[Hashable, int]], bucket_bytes: int) -> list[list[int]]:
    """Buckets of ``items`` (``(key, nbytes)`` in the order they become ready), as lists of indices.

    Items of one key fill one open bucket in order; the bucket closes when the next item of its key
    would take it past ``bucket_bytes`` (it then starts the next bucket), and at the end. Returned
    in the order the buckets become ready (their last member's index).
    """
    open_: dict[Hashable, list[int]] = {}
    size: dict[Hashable, int] = {}
    done: list[list[int]] = []
    for i, (key, nbytes) in enumerate(items):
        b = open_.get(key)
        if b and size[key] + nbytes > bucket_bytes:
            done.append(b)
            b = None
        if not b:
            open_[key], size[key] = [], 0
        open_[key].append(i)
        size[key] += nbytes
    done += [b for b in open_.values() if b]
    return sorted(done, key=lambda b: b[-1])


@dataclass
class _Member:
    coll: fx.Node
    wait: fx.Node
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    tail: list[fx.Node]

    @property
    def key(self) -> tuple:
        return (_OUT_OF_PLACE.get(self.coll.target, self.coll.target), tuple(self.coll.args[1:]), self.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def _tail(wait: fx.Node) -> Optional[list[fx.Node]]:
    """The view/copy nodes between ``wait`` and the output (in graph order), or None when the result
    has another kind of consumer."""
    found: list[fx.Node] = []
    stack = [wait]
    while stack:
        for u in stack.pop().users:
            if u.op == "output" or u in found:
                continue
            if u.op != "call_function" or u.target not in _TAIL:
                return None
            found.append(u)
            stack.append(u)
    order = {n: i for i, n in enumerate(wait.graph.nodes)}
    return sorted(found, key=order.__getitem__)


def _dtype(x: fx.Node) -> Optional[torch.dtype]:
    """The dtype of a collective's input: from the nearest value traced with one (inserted nodes
    carry none; a cast says its own)."""
    while isinstance(x, fx.Node):
        if x.target is aten._to_copy.default and "dtype" in x.kwargs:
            return x.kwargs["dtype"]
        val = x.meta.get("val")
        if isinstance(val, torch.Tensor) and not x.meta.get(INSERTED_KEY):
            return val.dtype
        x = x.args[0] if x.args else None
    return None


def _member(c: fx.Node) -> Optional[_Member]:
    info = c.meta.get(COMM_KEY)
    if c.target not in _BUCKETABLE or info is None or "shape" not in info or len(c.users) != 1:
        return None
    wait = next(iter(c.users))
    if wait.target is not c10d.wait_tensor.default or not all(is_concrete(s) for s in info["shape"]):
        return None
    dtype = _dtype(c.args[0])
    tail = _tail(wait)
    if dtype is None or not dtype.is_floating_point or tail is None:
        return None
    shape = tuple(int(s) for s in info["shape"])
    m = _Member(c, wait, shape, dtype, 0, tail)
    m.nbytes = m.numel * dtype.itemsize
    return m


def _hoist(x: fx.Node) -> None:
    """Move the chain of inserted single-input nodes ending at ``x`` to right after the value it reads."""
    chain = []
    while (x.op == "call_function" and x.meta.get(INSERTED_KEY) and COMM_KEY not in x.meta
           and x.target is not c10d.wait_tensor.default and len(x.all_input_nodes) == 1):
        chain.append(x)
        x = x.all_input_nodes[0]
    at = x
    for n in reversed(chain):
        at.append(n)
        at = n


def bucket_gradients(gm: fx.GraphModule, bucket_bytes: int) -> fx.GraphModule:
    """See module doc; changes ``gm`` in place, recompiles it and returns it."""
    g = gm.graph
    members = [m for m in (_member(n) for n in list(g.nodes) if COMM_KEY in n.meta) if m is not None]
    if not members:
        return gm
    for m in members:
        _hoist(m.coll.args[0])
    order = {n: i for i, n in enumerate(g.nodes)}
    members.sort(key=lambda m: order[m.coll.args[0]])
    output = next(n for n in reversed(g.nodes) if n.op == "output")
    for idx in plan_buckets([(m.key, m.nbytes) for m in members], bucket_bytes):
        _emit(g, [members[i] for i in idx], output)
    g.lint()
    gm.recompile()
    return gm


def bucket_pass(gm: fx.GraphModule, ctx: ShardContext) -> fx.GraphModule:
    """The pipeline stage (``pipeline.BUCKET``, on backward programs): :func:`bucket_gradients` with
    buckets of ``ctx.bucket_mb`` MiB; ``gm`` unchanged when that is None."""
    if ctx.bucket_mb is None:
        return gm
    return bucket_gradients(gm, int(ctx.bucket_mb * 2**20))


def _emit(g: fx.Graph, ms: list[_Member], output: fx.Node) -> None:
    """Replace the collectives of ``ms`` (in readiness order) by one, issued after the last input."""
    last_in = ms[-1].coll.args[0]
    if last_in.op == "placeholder":  # a gradient that is an input of the program: issue after all inputs
        last_in = [n for n in g.nodes if n.op == "placeholder"][-1]
    tails = [t for m in ms for t in m.tail]
    if len(ms) == 1:  # nothing to pack: issue it early, wait at the end
        last_in.append(ms[0].coll)
        for n in [ms[0].wait] + tails:
            output.prepend(n)
        return
    c0 = ms[0].coll
    rs = c0.target is c10d.reduce_scatter_tensor.default
    n_ranks = int(c0.args[2]) if rs else 1

    def op(at: fx.Node, target: Any, *args: Any) -> fx.Node:
        with g.inserting_before(at):
            node = g.call_function(target, args)
        node.meta[INSERTED_KEY] = True
        return node

    anchor = last_in.next
    flat = [op(anchor, aten.view.default, m.coll.args[0], [n_ranks, m.numel // n_ranks] if rs else [m.numel])
            for m in ms]
    buf = op(anchor, aten.cat.default, flat, 1 if rs else 0)
    if rs:
        buf = op(anchor, aten.view.default, buf, [sum(m.numel for m in ms)])
    coll = op(anchor, _OUT_OF_PLACE.get(c0.target, c0.target), buf, *c0.args[1:])
    info = dict(c0.meta[COMM_KEY])
    info.update(bytes=sum(int(m.coll.meta[COMM_KEY]["bytes"]) for m in ms), value=f"bucket of {len(ms)}",
                consumer="output", op="output", source="", bucket=[m.coll.meta[COMM_KEY]["value"] for m in ms])
    info.pop("shape", None)
    coll.meta[COMM_KEY] = info
    wait = op(output, c10d.wait_tensor.default, coll)
    pieces = op(output, aten.split_with_sizes.default, wait, [m.numel // n_ranks for m in ms])
    for i, m in enumerate(ms):
        shape = [m.shape[0] // n_ranks] + list(m.shape[1:]) if rs else list(m.shape)
        piece = op(output, aten.view.default, op(output, operator.getitem, pieces, i), shape)
        # the member's value and layout: a traced op of its tail (a norm weight gradient's view) reads it
        piece.meta.update({k: m.wait.meta[k] for k in ("val", META_KEY) if k in m.wait.meta})
        m.wait.replace_all_uses_with(piece)
    for t in tails:
        output.prepend(t)
    for m in ms:
        g.erase_node(m.wait)
        g.erase_node(m.coll)
