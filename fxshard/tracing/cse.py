"""Common-subexpression elimination of traced graphs (export repeats views per consumer)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from ..core.torch_compat import pytree

from ..core.torch_compat import OpOverload, OpOverloadPacket

aten = torch.ops.aten

__all__ = ["cse"]


class _RandomOps:
    """The op packets CSE must keep apart: any overload tagged ``nondeterministic_seeded``."""

    def __contains__(self, packet: Any) -> bool:
        return isinstance(packet, OpOverloadPacket) and any(
            torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads())


def cse(gm: fx.GraphModule, keep_casts: bool = False) -> fx.GraphModule:
    """Merge identical pure nodes (export repeats views per consumer), keeping node metadata.

    ``keep_casts``: casts to another dtype (``_to_copy`` with ``dtype``) stay apart, for a graph autograd has
    not run over yet: eager casts twice where the code does (autocast casts each use of a value except a
    parameter it caches), and the gradients of two casts sum in the wider dtype, those of one in the narrower.

    Requires a functional graph: two equal nodes of a graph that mutates could hold different values
    by the time they are read, so a graph with any in-place op is returned unchanged.
    Ensures what torch's ``CSEPass`` does (same keys: target and flattened arguments; the first of
    equal nodes kept; random ops never merged), in place: ``CSEPass`` builds an eagerly compiled
    GraphModule, whose Python codegen is most of its cost on a large graph.
    """
    from ..core.torch_compat import get_graph_module_cls as _get_graph_module_cls

    if any(isinstance(n.target, OpOverload) and n.target._schema.is_mutable for n in gm.graph.nodes):
        return gm
    random = _RandomOps()  # two draws are two draws: never merge random ops
    seen: dict[Any, list[tuple[Any, fx.Node]]] = {}
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or getattr(n.target, "overloadpacket", n.target) in random:
            continue
        if keep_casts and n.target is aten._to_copy.default and "dtype" in n.kwargs:
            continue
        # earlier merges already rewrote n's arguments to the kept nodes
        args, args_spec = pytree.tree_flatten(n.args)
        kwargs, kwargs_spec = pytree.tree_flatten(n.kwargs)
        same = seen.setdefault((n.target, tuple(args), tuple(kwargs)), [])
        first = next((m for specs, m in same if specs == (args_spec, kwargs_spec)), None)  # specs: unhashable
        if first is None:
            same.append(((args_spec, kwargs_spec), n))
        else:
            n.replace_all_uses_with(first)
            gm.graph.erase_node(n)
    cls = _get_graph_module_cls()  # lazy while shard() runs: later passes' recompiles only mark the code stale
    out = gm if isinstance(gm, cls) else cls(gm, gm.graph)
    out.recompile()
    return out
