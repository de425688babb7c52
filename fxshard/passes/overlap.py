"""Pass overlap: issue collectives early, wait late (per-rank programs; ``Pipeline`` option).

Requires: a finished per-rank program (``passes/emit.py``) whose collectives carry ``COMM_KEY``
and are each read by one ``wait_tensor``. Ensures: the same dataflow in another topological
order (``reorder_for_overlap``), with collectives, random ops and mutating ops in their original
relative order. The redistribute pass puts each collective directly before its wait, right before
the first consumer (buffers die early, seed 002); this pass trades that for overlap.
"""

from __future__ import annotations

import heapq
import logging
from types import MappingProxyType
from typing import Any, Mapping, Optional

import torch
import torch.fx as fx

from ..analysis.liveness import local_bytes, liveness_peak
from ..core.context import ShardContext
from ..core.errors import ShardingError
from ..core.ir import COMM_KEY
from ..core.torch_compat import OpOverload

__all__ = ["overlap_pass", "reorder_for_overlap", "overlap_order", "collective_groups", "INDUCTOR_OPTIONS"]

logger = logging.getLogger(__name__)

PEAK_SLACK = 0.01  # the overlap order may raise a program's modelled peak memory by at most this fraction

# Inductor options that keep this pass's schedule (read-only; pass ``dict(INDUCTOR_OPTIONS)``). Inductor's
# scheduler keeps a graph's order except where ``reorder_for_peak_memory`` moves nodes, and that moves
# every ``wait_tensor`` back next to its collective (the weight gradients that ran between go
# elsewhere): the overlap is lost. Without it inductor runs this pass's order, whose modelled peak is
# within ``PEAK_SLACK`` of the redistribute order's, instead of searching for a lower-peak order.
INDUCTOR_OPTIONS: Mapping[str, Any] = MappingProxyType({"reorder_for_peak_memory": False})

c10d = torch.ops._c10d_functional


_WAIT = c10d.wait_tensor.default


def collective_groups(g: fx.Graph) -> list[tuple[fx.Node, fx.Node]]:
    return [(n, next(iter(n.users))) for n in g.nodes if COMM_KEY in n.meta and len(n.users) == 1
            and next(iter(n.users)).target is _WAIT]


def _keeps_order(n: fx.Node) -> bool:
    """Ops whose relative order is observable: collectives (every rank must issue the same sequence),
    random ops (the generator's sequence of draws), and ops that mutate an input."""
    if COMM_KEY in n.meta:
        return True
    t = n.target
    if isinstance(t, OpOverload):
        return torch.Tag.nondeterministic_seeded in t.tags or t._schema.is_mutable
    return False


def reorder_for_overlap(gm: fx.GraphModule) -> fx.GraphModule:
    """Reschedule ``gm`` so collectives are issued as early as their inputs allow and waited as late
    as possible; recompile. Returns ``gm`` (changed in place).

    Requires a graph whose collectives carry ``COMM_KEY`` and are each read by one ``wait_tensor``.
    Ensures the same dataflow in another topological order, by list scheduling: the ops the next
    collective needs (and the collective) run first, then ordinary ops in their original order, and
    a ``wait_tensor`` only when no other op is ready - so every op independent of a collective's
    result (e.g. the weight gradients next to an input-gradient all-reduce) runs between its issue
    and its wait. Collectives, random ops and mutating ops keep their original relative order
    (every rank issues the same collective sequence; random draws stay bit-identical to eager).
    """
    order = overlap_order(gm.graph)
    if order is not None:
        _place(gm.graph, order)
        gm.recompile()
    return gm


def overlap_order(g: fx.Graph) -> Optional[list[fx.Node]]:
    """The node order :func:`reorder_for_overlap` gives ``g`` (None: ``g`` has no collective)."""
    groups = collective_groups(g)
    if not groups:
        return None
    nodes = list(g.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    waits = {w for _c, w in groups}
    deps = {n: set(n.all_input_nodes) for n in nodes}
    ordered = [n for n in nodes if _keeps_order(n)]
    for a, b in zip(ordered, ordered[1:]):  # an order edge between consecutive order-keeping ops
        deps[b].add(a)
    users: dict[fx.Node, list[fx.Node]] = {n: [] for n in nodes}
    for n in nodes:
        for a in deps[n]:
            users[a].append(n)
    missing = {n: len(deps[n]) for n in nodes}

    def ancestors(c: fx.Node) -> set:
        out = {c}
        stack = [c]
        while stack:
            for a in deps[stack.pop()]:
                if a not in out:
                    out.add(a)
                    stack.append(a)
        return out

    pending = [c for c, _w in groups]  # collectives not issued yet, in order
    urgent = ancestors(pending[0])  # what the next collective needs: run it first, issue early

    def key(n: fx.Node) -> tuple:
        if n.op == "placeholder":
            return (0, index[n])
        if n.op == "output":
            return (9, index[n])
        if n in waits:
            return (3, index[n])
        return (1 if n in urgent else 2, index[n])

    ready = [(key(n), index[n], n) for n in nodes if missing[n] == 0]
    heapq.heapify(ready)
    order: list[fx.Node] = []
    while ready:
        n = heapq.heappop(ready)[2]
        order.append(n)
        if pending and n is pending[0]:
            pending.pop(0)
            urgent = ancestors(pending[0]) if pending else set()
            ready = [(key(r), index[r], r) for _k, _i, r in ready]
            heapq.heapify(ready)
        for u in users[n]:
            missing[u] -= 1
            if missing[u] == 0:
                heapq.heappush(ready, (key(u), index[u], u))
    if len(order) != len(nodes):
        raise ShardingError("internal: reorder_for_overlap could not schedule every node; please report this graph")
    return order


def _place(g: fx.Graph, order: list[fx.Node]) -> None:
    """Put ``g``'s nodes in ``order`` (a topological order of all of them)."""
    for prev, n in zip(order, order[1:]):
        prev.append(n)
    g.lint()


def overlap_pass(gm: fx.GraphModule, ctx: ShardContext) -> fx.GraphModule:
    """The pipeline stage (``pipeline.OVERLAP``, in ``DEFAULT``): :func:`reorder_for_overlap`, kept only
    where it does not raise the program's peak memory. Returns ``gm`` (changed in place).

    Requires a finished per-rank program (see :func:`reorder_for_overlap`). Ensures: ``gm`` in the overlap
    order when the liveness model of ``fxshard.memory`` (this rank's local shapes, each value live from the
    op that makes it to its last use, a collective's inputs until its wait) gives it a peak at most
    ``PEAK_SLACK`` (1%) above the program's own order's, else in its own order. Issuing a collective early
    can make its output live longer (e.g. a parameter all-gather hoisted to the start of the program);
    the check keeps such a schedule out."""
    order = overlap_order(gm.graph)
    if order is None:
        return gm
    own = list(gm.graph.nodes)
    try:
        nbytes = local_bytes(gm, ctx.mesh, ctx.program_inputs() if ctx.program_inputs else ())
    except Exception as e:  # noqa: BLE001 - no model of the program's memory: keep the order that needs none
        logger.debug("overlap: kept the program's own order; its memory could not be modelled: %s: %s",
                     type(e).__name__, e)
        return gm
    before = liveness_peak(gm, nbytes)
    _place(gm.graph, order)
    after = liveness_peak(gm, nbytes)
    if after > before * (1 + PEAK_SLACK):
        logger.debug("overlap: kept the program's own order; the overlap order's peak %d bytes exceeds its %d",
                     after, before)
        _place(gm.graph, own)  # the code compiled for this order is still current
    else:
        gm.recompile()
    return gm
