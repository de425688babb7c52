"""Peephole clean-ups that leave every value unchanged and run fewer ops.

Each kernel launched from a GraphModule costs a few microseconds of Python and
dispatch, so the per-rank programs of a small model pay for chains of views that
eager autograd never materializes (the joint graph transposes a weight in the
forward and transposes that transpose again in the backward).

``drop_noop_clones(gm)`` requires a functional graph with ``meta["val"]`` on
every node (the traced global program) and ensures that no ``clone`` of a
non-overlapping, dense value whose copy is not returned is left: such a copy
(what ``dropout(p=0)`` traces to) has its input's strides and values, and
nothing in a functional graph can tell it from its input.

``fold_views(gm)`` requires a per-rank program (shape arguments already local)
and ensures that no ``permute`` reads a ``permute`` (the two compose into one,
or into nothing when they cancel) and no ``view`` reads a ``view`` (a view of a
view of ``x`` is a view of ``x``: a tensor can be viewed as a shape exactly when
its stride breaks fall on that shape's dim boundaries, and a view keeps the
breaks of its base), and no ``alias`` is left (in a functional graph an alias is
its input; the traced forward keeps one where a stop-gradient was, see
``tracing/export.py``). Neither pass lets a graph output become a placeholder.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ..core.ir import IN_KEY, META_KEY, OpClass, is_op
from ..core.spec import Spec
from ..core.torch_compat import is_non_overlapping_and_dense_or_false

aten = torch.ops.aten

__all__ = ["drop_noop_clones", "fold_views"]

def _is_mutating(n: fx.Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return n.op == "call_function" and schema is not None and schema.is_mutable


def _returned(n: fx.Node) -> bool:
    return any(u.op == "output" for u in n.users)


def _replace(n: fx.Node, by: Any) -> bool:
    """Route ``n``'s users to ``by`` unless that would return a placeholder; True when done."""
    if _returned(n) and isinstance(by, fx.Node) and by.op == "placeholder":
        return False
    n.replace_all_uses_with(by)
    n.graph.erase_node(n)
    return True


def drop_noop_clones(gm: fx.GraphModule) -> fx.GraphModule:
    """See module doc."""
    g = gm.graph
    if any(_is_mutating(n) for n in g.nodes):
        return gm
    changed = False
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is not aten.clone.default or _returned(n):
            continue
        src = n.args[0]
        val = src.meta.get("val") if isinstance(src, fx.Node) else None
        fmt = n.kwargs.get("memory_format", torch.preserve_format)
        if not isinstance(val, torch.Tensor) or not is_non_overlapping_and_dense_or_false(val):
            continue
        if fmt not in (None, torch.preserve_format) and not (fmt == torch.contiguous_format and val.is_contiguous()):
            continue
        changed |= _replace(n, src)
    if changed:
        gm.recompile()
    return gm


def _read_base(n: fx.Node, base: fx.Node, *rest: Any) -> None:
    """Make view ``n`` read ``base`` directly; its input requirement becomes ``base``'s layout."""
    n.args = (base,) + rest
    spec = base.meta.get(META_KEY)
    if IN_KEY in n.meta and isinstance(spec, Spec):
        n.meta[IN_KEY] = [spec.placements]


def fold_views(gm: fx.GraphModule) -> fx.GraphModule:
    """See module doc."""
    g = gm.graph
    changed = False
    for n in list(g.nodes):
        if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
            continue
        a = n.args[0]
        if n.target is aten.alias.default:
            changed |= _replace(n, a)
            continue
        base = a.args[0] if a.op == "call_function" and a.args else None
        if not (isinstance(base, fx.Node) and isinstance(base.meta.get("val"), torch.Tensor)):
            base = None  # fold only onto traced values (inserted nodes carry no value to reason about)
        if n.target is aten.permute.default:
            k = len(n.args[1])
            perm = [p % k for p in n.args[1]]
            if base is not None and a.target is aten.permute.default:
                inner = [p % k for p in a.args[1]]
                perm = [inner[p] for p in perm]
                _read_base(n, base, perm)
                changed = True
            if perm == list(range(k)):
                changed |= _replace(n, n.args[0])
        elif base is not None and is_op(n.target, OpClass.RESHAPE) and is_op(a.target, OpClass.RESHAPE):
            _read_base(n, base, *n.args[1:])
            changed = True
    if changed:
        g.eliminate_dead_code()
        gm.recompile()
    return gm
