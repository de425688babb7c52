"""Keep the memory layouts a traced program relies on when sharding changes its inputs' layouts.

A traced graph encodes the layouts its values had while tracing: ``torch.export``
drops a ``.contiguous()`` that was a no-op then, and keeps a ``view`` that was
valid for those strides. Some fused kernels give their outputs the stride order
of their inputs (CPU flash attention, in a graph that calls that kernel itself:
``out`` and the gradients follow ``q``, ``k``, ``v``), so once a collective hands
such a kernel a contiguous copy of what was a transposed view, a later ``view`` of
its output fails. The other layouts a program reads are fixed by construction:
collectives take and give contiguous buffers (``collectives.py``), and fxshard's
attention node (``fxshard/ops/attention.py``) always returns contiguous outputs,
whichever kernel runs it.

``pin_layouts(gm)`` requires a localized program whose nodes still carry their
traced ``meta["val"]`` and ensures that every output of a ``LAYOUT_FOLLOWS_INPUTS``
op that was traced non-contiguous and is read by a view op reaches its users in
the traced stride order: ``permute(contiguous(permute(x, order)), inverse)``,
where ``contiguous`` copies only when the order differs at run time (and the
permutes fold into their users, ``tracing/simplify.py::fold_views``).
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from .ir import INSERTED_KEY, VIEW_OPS, OpClass, is_op
from .torch_compat import optimization_hint

aten = torch.ops.aten

__all__ = ["pin_layouts", "pin", "LAYOUT_FOLLOWS_INPUTS", "memory_order", "reads_strides"]

LAYOUT_FOLLOWS_INPUTS = frozenset(op for op in (
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
) if is_op(op, OpClass.LAYOUT_FOLLOWS_INPUTS))


def memory_order(val: torch.Tensor) -> Optional[list[int]]:
    """The dims of ``val`` from largest to smallest stride, or None when that is the identity (or unknown)."""
    strides = [optimization_hint(s, fallback=1) for s in val.stride()]  # hints: no guards on symbolic sizes
    sizes = [optimization_hint(s, fallback=2) for s in val.shape]
    order = sorted(range(val.dim()), key=lambda d: (-strides[d], d))
    keyed = [d for d in order if sizes[d] != 1]  # size-1 dims have arbitrary strides
    if keyed == [d for d in range(val.dim()) if sizes[d] != 1]:
        return None
    return order


# views that need their input's strides to fit (the others only relabel dims and pass the layout on)
_STRIDED = frozenset({aten.view.default, aten._unsafe_view.default, aten.as_strided.default,
                      aten.view_as_complex.default, aten.view_as_real.default})


def reads_strides(x: fx.Node) -> bool:
    """Whether some consumer of ``x``, directly or through views that pass its layout on (permute, slice,
    ...), is a view whose result depends on ``x``'s strides (``view`` of merged dims, ``as_strided``)."""
    todo, seen = [x], {x}
    while todo:
        for u in todo.pop().users:
            if u.target in _STRIDED:
                return True
            if u.target in VIEW_OPS and u not in seen:
                seen.add(u)
                todo.append(u)
    return False


def pin(g: fx.Graph, x: fx.Node, order: list[int]) -> fx.Node:
    """``permute(contiguous(permute(x, order)), inverse)`` right after ``x`` (which must carry its traced
    ``meta["val"]``), in place of ``x`` for its users: ``x`` dense in the stride order ``order``. Returns it."""
    inverse = [order.index(d) for d in range(len(order))]
    users = [u for u in x.users]
    with g.inserting_after(x):
        p = g.call_function(aten.permute.default, (x, order))
    with g.inserting_after(p):
        c = g.call_function(aten.contiguous.default, (p,))
    with g.inserting_after(c):
        back = g.call_function(aten.permute.default, (c, inverse))
    val = x.meta["val"]
    p.meta["val"] = val.permute(order)
    c.meta["val"] = p.meta["val"].contiguous()
    back.meta.update(x.meta)
    back.meta["val"] = c.meta["val"].permute(inverse)
    for n in (p, c, back):
        n.meta[INSERTED_KEY] = True
    for u in users:
        u.replace_input_with(x, back)
    return back


def pin_layouts(gm: fx.GraphModule) -> fx.GraphModule:
    """See module doc."""
    g = gm.graph
    for n in list(g.nodes):
        if n.op != "call_function" or n.target not in LAYOUT_FOLLOWS_INPUTS:
            continue
        for item in [u for u in n.users if u.target is operator.getitem]:
            val = item.meta.get("val")
            if not isinstance(val, torch.Tensor) or not any(u.target in VIEW_OPS for u in item.users):
                continue
            order = memory_order(val)
            if order is not None:
                pin(g, item, order)
    return gm
