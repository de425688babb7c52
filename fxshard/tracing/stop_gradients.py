"""Stop-gradients in the traced forward: ``.detach()`` and ``torch.no_grad()`` regions as eager differentiates them.

``mark_stop_gradients`` routes, in an exported graph, every ``detach`` and every value a ``no_grad`` region
hands back without a gradient through ``STOP_GRADIENT`` (the ``fxshard::stop_gradient`` op, which the
decompositions keep, where they turn ``detach`` into ``alias`` and inline the regions); once the graph is
decomposed, ``flag_stop_gradients`` makes each of them an ``aten.alias`` node flagged ``meta[STOP_KEY]``
(``trace_joint`` detaches there). In-place writes that eager's autograd would not see are a ShardingError.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx
from ..core.torch_compat import pytree

from ..core.errors import ShardingError
from ..core.ir import STOP_KEY, source_line
from ..core.torch_compat import OpOverload

aten = torch.ops.aten

__all__ = ["STOP_GRADIENT", "mark_stop_gradients", "flag_stop_gradients"]


@torch.library.custom_op("fxshard::stop_gradient", mutates_args=())
def _stop_gradient(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_stop_gradient.register_fake
def _stop_gradient_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


_stop_gradient.register_autograd(lambda ctx, grad: None)
# The marker: its value is its input's, no gradient flows through it, and the decompositions keep it.
STOP_GRADIENT = torch.ops.fxshard.stop_gradient.default


# Ops whose result never needs a gradient, whatever their inputs (``_needs_grad``): fresh tensors shaped like one.
_NO_GRADIENT = frozenset({
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
    aten.rand_like.default, aten.randn_like.default, aten.randint_like.default, aten.randint_like.low_dtype,
    aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default,
    aten.detach.default, STOP_GRADIENT,
})


def mark_stop_gradients(gm: fx.GraphModule) -> None:
    """Requires: ``gm`` an exported program's graph (its nodes carry ``meta["val"]``). Ensures, in place:
    route every ``detach`` and every value leaving a ``no_grad`` region (export's
    ``wrap_with_set_grad_enabled(False, ...)``) that eager hands back without a gradient through
    ``fxshard::stop_gradient``, an op the decompositions keep (they turn ``detach`` into ``alias`` and
    inline the regions).

    Which region outputs keep their gradient is what eager does (:func:`_region_in_eager`): an output that
    is one of the region's inputs itself (a no-op ``.to``/``.float()``/``.type_as``, ``requires_grad_()``;
    export then maps every later use of the input to that output) keeps it; views and new tensors made
    under ``no_grad`` do not. A tensor the region writes in place keeps its later value without a gradient
    through the write (``copy_`` of its stop-gradient after the region: eager's write is invisible to
    autograd), unless it needs a gradient itself (``_needs_grad``): eager then differentiates through it
    as if the write had not happened, or fails in backward where the written value was saved; one
    traced program reproduces neither, so that is a ShardingError. A parameter or input written there
    is left to ``trace_forward``'s mutation check."""
    for mod in gm.modules():
        if not isinstance(mod, fx.GraphModule):
            continue
        g = mod.graph
        rg: dict[fx.Node, bool] = {}
        for n in list(g.nodes):
            if n.op == "call_function" and n.target is aten.detach.default:
                if _written_through(n) is None:
                    n.target = STOP_GRADIENT
                else:  # an in-place write to the detached alias is one to its source: keep them one tensor
                    _check_write_through_detach(n)
            elif (n.op == "call_function" and n.target is torch.ops.higher_order.wrap_with_set_grad_enabled
                  and n.args[0] is False):
                _stop_region_outputs(mod, n, rg)
                continue
            rg[n] = _needs_grad(n, rg, mod is gm)
        mod.recompile()


def _needs_grad(n: fx.Node, rg: dict[fx.Node, bool], root: bool) -> bool:
    """Whether ``n`` may need a gradient in eager (never False where eager's does): a floating or complex
    value computed from one that does (``rg``, per node so far), a parameter or input that requires grad;
    a placeholder of a region's graph (``root`` False) may."""
    v = n.meta.get("val")
    if isinstance(v, torch.Tensor) and not (v.is_floating_point() or v.is_complex()):
        return False
    if n.op == "placeholder":
        return not root or bool(getattr(v, "requires_grad", False))
    if n.op != "call_function" or n.target in _NO_GRADIENT:
        return False
    return any(rg.get(a, False) for a in pytree.tree_leaves((n.args, n.kwargs)) if isinstance(a, fx.Node))


def _stop_region_outputs(mod: fx.GraphModule, region: fx.Node, rg: dict[fx.Node, bool]) -> None:
    """Requires: ``region`` a ``wrap_with_set_grad_enabled(False, ...)`` node of ``mod``'s graph, ``rg``
    :func:`_needs_grad` of the nodes before it. Ensures: its outputs without a gradient in eager reach their
    users through ``fxshard::stop_gradient``; a tensor it writes in place is a stop-gradient of its new
    value after it, or a ShardingError when that tensor needs a gradient (see :func:`mark_stop_gradients`)."""
    g = mod.graph
    ins = list(region.args[2:])
    same: dict[int, int] = {}
    written: set[int] = set()
    grad_out: set[int] = set()
    if any(isinstance(a, fx.Node) and rg.get(a, False) for a in ins):  # else no gradient can leave it
        same, written, grad_out = _region_in_eager(getattr(mod, region.args[1].target), ins)
    after = region
    for i in sorted(written):
        x = ins[i]
        if x.op != "placeholder" and rg.get(x, False):
            raise ShardingError(
                f"forward writes a tensor that needs a gradient (computed at {source_line(x) or x.name}) in place "
                f"under torch.no_grad() ({_first_write(getattr(mod, region.args[1].target), i)}): "
                f"eager's autograd does not see that write (it differentiates as if it had not happened, "
                f"or fails in backward where the old value was saved), which one traced program cannot reproduce; "
                f"compute the new value out-of-place (h = h * 2 instead of h.mul_(2)), under torch.no_grad() "
                f"if it should carry no gradient")
        with g.inserting_after(after):
            stop = g.call_function(STOP_GRADIENT, (x,))
        with g.inserting_after(stop):
            after = g.call_function(aten.copy_.default, (x, stop))
        stop.meta.update(x.meta)
        after.meta.update(x.meta)
    for out in list(region.users):
        k = out.args[1] if out.op == "call_function" and out.target is operator.getitem else None
        if k in grad_out and same.get(k) not in written:
            rg[out] = rg.get(ins[same[k]], False) if k in same else True
            continue
        with g.inserting_after(out):
            stop = g.call_function(STOP_GRADIENT, (out,))
        stop.meta.update(out.meta)
        out.replace_all_uses_with(stop, delete_user_cb=lambda u, stop=stop: u is not stop)
        rg[out] = False


def _region_in_eager(sub: fx.GraphModule, ins: list) -> tuple[dict[int, int], set[int], set[int]]:
    """Runs ``sub`` (a grad-disabled region's graph; ``ins`` its arguments, nodes with fake values) as eager
    would, under ``no_grad`` on fake tensors, every floating input requiring grad. Returns: which outputs
    are an input itself (output index -> input index), which inputs it writes in place (their version
    counter moved), and which outputs carry a gradient (inputs themselves, or made under a nested
    ``enable_grad``; a view made under ``no_grad`` reports ``requires_grad`` but is a leaf: no gradient
    reaches its base through it)."""
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in ins]
    mode = next((v.fake_mode for v in vals if hasattr(v, "fake_mode")), None)
    if mode is None:  # no tensor comes in: every output is made inside
        return {}, set(), set()
    with mode:
        args = [v.detach().requires_grad_(v.is_floating_point() or v.is_complex()) if isinstance(v, torch.Tensor)
                else v for v in vals]
        versions = [a._version if isinstance(a, torch.Tensor) else None for a in args]
        with torch.no_grad():
            outs = sub(*args)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    same = {k: i for k, o in enumerate(outs) for i, a in enumerate(args) if isinstance(o, torch.Tensor) and o is a}
    written = {i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a._version != versions[i]}
    grad_out = set(same) | {k for k, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.grad_fn is not None}
    return same, written, grad_out


def _first_write(sub: fx.GraphModule, i: int) -> str:
    """Where ``sub``'s ``i``-th placeholder is first written in place (for messages)."""
    x = [n for n in sub.graph.nodes if n.op == "placeholder"][i]
    w = _written_through(x)
    return f"{w.target} at {source_line(w) or 'an unknown line'}" if w is not None else "a write"


def _written_through(node: fx.Node) -> Optional[fx.Node]:
    """The first op that writes ``node``'s storage in place, directly or through views of it, or None."""
    todo, seen = [node], {node}
    while todo:
        x = todo.pop()
        for u in x.users:
            if u.op != "call_function" or not isinstance(u.target, OpOverload):
                continue
            schema = u.target._schema
            given = dict(zip((a.name for a in schema.arguments), u.args)) | dict(u.kwargs)
            for a in schema.arguments:
                if given.get(a.name) is not x or a.alias_info is None:
                    continue
                if a.alias_info.is_write:
                    return u
                if u not in seen and any(r.alias_info is not None and r.alias_info.before_set
                                         & a.alias_info.before_set for r in schema.returns):
                    seen.add(u)  # a view of it
                    todo.append(u)
    return None


def _check_write_through_detach(node: fx.Node) -> None:
    """Requires: an op writes ``node`` (a ``detach``) in place. Ensures: ShardingError unless its source is a
    graph input (a parameter, buffer or input: the write is then traced as that input's update, which
    ``trace_forward`` accepts for buffers and refuses for the others)."""
    if node.args[0].op == "placeholder":
        return
    writer = _written_through(node)
    raise ShardingError(
        f"forward writes a detached tensor in place ({writer.target} at {source_line(writer) or 'an unknown line'}): "
        f"in eager that changes the value it was detached from without recording it for autograd, which one "
        f"traced program cannot reproduce; compute a new tensor (out-of-place) instead")


def flag_stop_gradients(gm: fx.GraphModule) -> None:
    """Requires: ``gm`` decomposed from a graph :func:`mark_stop_gradients` marked.
    Ensures: the markers (``STOP_GRADIENT`` nodes) become ``aten.alias`` nodes flagged ``meta[STOP_KEY]``
    (see module doc), in place."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is STOP_GRADIENT:
            n.target = aten.alias.default
            n.meta[STOP_KEY] = True
    gm.recompile()
