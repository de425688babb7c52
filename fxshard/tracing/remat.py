"""Rematerialisation (activation checkpointing) policies of the training partition.

``joint.partition`` splits a sharded joint graph into a forward that saves values and a backward
that reads them. A policy decides which forward values the backward *recomputes* from other saved
values instead of reading them saved (``recomputed``):

* ``"none"``: save every forward value the backward reads (only views of parameters are
  recomputed, under every policy).
* ``"layers"``: full activation checkpointing per layer. A *layer* is a module whose path ends in
  an integer (an element of a ``ModuleList``/``Sequential``: ``layers.3``, ``h.0``), the outermost
  one on a node's module stack; nodes fxshard inserted (collectives, layout copies) belong to the
  layer of their first input. Every value computed inside a layer is recomputed, except the layer's
  boundary (values read outside the layer in the forward: its output), random draws (dropout
  masks) and the results of collectives, which are saved: the backward of a layer reruns its
  forward's computation from its saved input without communicating again.
* ``"auto"``: the minimum cut AOTAutograd's partitioner takes, restricted to cheap ops: values of
  elementwise ops and views (``torch.Tag.pointwise``, ``ir.VIEW_OPS``) may be recomputed; every other
  op's value (matmuls, reductions, collectives, random draws) is saved when the backward needs it or
  something recomputed from it. Among those choices the saved set of fewest (local) bytes is taken,
  by a max-flow/min-cut over the forward graph (networkx), where saving a value costs its bytes and
  primals cost nothing (they are held anyway).

Random ops are never recomputed (a second draw would differ from the first), so every policy gives
the gradients of ``"none"``; collectives are not either (no communication is added to the backward).

A *budget* (``shard(..., remat="auto" | "layers", remat_budget=...)``) bounds the bytes of the
activations the forward saves on each rank: a number of bytes (``"2GiB"`` works) or, as a float in
``(0, 1]``, a fraction of what ``"none"`` saves (like AOTAutograd's ``activation_memory_budget``).
The policy's own choice (``"auto"``'s cut; nothing for ``"layers"``) is kept if it fits; otherwise
whole layers are checkpointed too, the first layers first (their activations live longest), as few
as fit. A budget that even every layer checkpointed does not meet is a ShardingError giving the
smallest saved size found.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.fx as fx

from ..comm.collectives import hint
from ..core.errors import ShardingError
from ..core.sizes import fmt_bytes, parse_bytes
from ..core.ir import INSERTED_KEY, META_KEY, VIEW_OPS, is_random
from ..core.spec import Spec
from ..core.torch_compat import OpOverload

__all__ = ["POLICIES", "Policy", "check_policy", "recomputed", "layer_sets", "fit_budget", "value_bytes"]

POLICIES = ("none", "layers", "auto")


@dataclass(frozen=True)
class Policy:
    """A rematerialisation policy: its name (``POLICIES``) and the budget of saved activations per rank
    (None: unbounded; a float in ``(0, 1]``: a fraction of what ``"none"`` saves; else bytes)."""

    name: str = "none"
    budget: Union[None, int, float] = None


def check_policy(remat: Any, budget: Union[None, int, float, str] = None) -> Policy:
    """The :class:`Policy` ``remat`` names with ``budget``, else a ShardingError saying what to pass."""
    if isinstance(remat, Policy):
        return remat
    if not isinstance(remat, str) or remat not in POLICIES:
        raise ShardingError(f"remat={remat!r} is not a rematerialisation policy; use one of {POLICIES} (default "
                            f"'none': save every activation the backward reads; 'layers': recompute each layer's "
                            f"forward in the backward; 'auto': recompute cheap elementwise ops where that saves memory)")
    if budget is None:
        return Policy(remat)
    if remat == "none":
        raise ShardingError(f"remat_budget={budget!r} was given with remat='none', which recomputes nothing; pass "
                            f"remat='auto' (cheap ops, then whole layers as needed) or remat='layers'")
    if isinstance(budget, float) and 0 < budget <= 1:
        return Policy(remat, budget)
    return Policy(remat, parse_bytes(budget, "remat_budget"))


def _tensor_valued(n: fx.Node) -> bool:
    v = n.meta.get("val")
    if isinstance(v, (tuple, list)):
        return all(isinstance(x, torch.Tensor) or x is None for x in v)
    return isinstance(v, torch.Tensor)


def _communicates(n: fx.Node) -> bool:
    return isinstance(n.target, OpOverload) and n.target.namespace in ("_c10d_functional", "c10d")


def _recomputable(n: fx.Node) -> bool:
    """An op the backward may run again: deterministic, local (no collective), tensor results."""
    return n.op == "call_function" and not is_random(n) and not _communicates(n) and _tensor_valued(n)


def _block(n: fx.Node) -> Optional[str]:
    """The outermost module on ``n``'s stack whose path ends in an integer (a ModuleList element)."""
    for entry in (n.meta.get("nn_module_stack") or {}).values():
        path = entry[0] if isinstance(entry, tuple) else str(entry)
        if path.rpartition(".")[2].isdigit():
            return path
    return None


def layer_sets(g: fx.Graph, forward: set[fx.Node], fwd_outs: Sequence[Any]) -> list[set[fx.Node]]:
    """Per layer, in forward order: the nodes ``"layers"`` recomputes (see module doc)."""
    layer: dict[fx.Node, Optional[str]] = {}
    for n in g.nodes:
        if n not in forward or n.op != "call_function":
            continue
        if n.meta.get("nn_module_stack") and not n.meta.get(INSERTED_KEY):
            layer[n] = _block(n)
        else:  # inserted by fxshard or by the trace: the layer of its first input that has one
            layer[n] = next((layer[a] for a in n.all_input_nodes if layer.get(a)), None)
    outs = {o for o in fwd_outs if isinstance(o, fx.Node)}
    chosen: dict[str, set[fx.Node]] = {}
    for n, name in layer.items():
        if name is None or not _recomputable(n) or n in outs:
            continue
        if all(layer.get(u) == name for u in n.users if u in forward):
            chosen.setdefault(name, set()).add(n)
    return list(chosen.values())


def _cheap(n: fx.Node) -> bool:
    t = n.target
    return _recomputable(n) and (t is operator.getitem or t in VIEW_OPS or (
        isinstance(t, OpOverload) and torch.Tag.pointwise in t.tags))


def value_bytes(n: fx.Node, sizes: Sequence[int]) -> int:
    """Local bytes of ``n``'s value (global bytes when it carries no spec)."""
    spec, val = n.meta.get(META_KEY), n.meta.get("val")
    specs = spec if isinstance(spec, tuple) else (spec,)
    vals = val if isinstance(val, (tuple, list)) else (val,)
    total = 0
    for s, v in zip(specs, vals):
        if isinstance(s, Spec):
            total += hint(s.local_bytes(sizes))
        elif isinstance(v, torch.Tensor):
            total += hint(v.numel()) * v.element_size()
        else:
            total += 8
    return max(total, 1)


def _min_cut(g: fx.Graph, forward: set[fx.Node], reads: set[fx.Node], sizes: Sequence[int]) -> set[fx.Node]:
    import networkx as nx

    net = nx.DiGraph()
    src, sink = "__source__", "__sink__"
    for n in g.nodes:
        if n not in forward:
            continue
        tuple_valued = isinstance(n.meta.get("val"), (tuple, list))
        if n.op == "placeholder":
            net.add_edge(src, (n, "in"))
            net.add_edge((n, "in"), (n, "out"), capacity=0)
        else:
            if not _cheap(n):
                net.add_edge(src, (n, "in"))  # available to the backward only by saving it
            if tuple_valued:  # saved as its items, never as the tuple
                net.add_edge((n, "in"), (n, "out"))
            else:
                net.add_edge((n, "in"), (n, "out"), capacity=value_bytes(n, sizes))
        for u in n.users:
            if u in forward:
                net.add_edge((n, "out"), (u, "in"))
        if n in reads:
            net.add_edge((n, "out"), sink)
    if sink not in net:
        return set()
    try:
        _, (reached, _) = nx.minimum_cut(net, src, sink)
    except nx.NetworkXException as e:  # an unbounded cut would be a bug of the graph above, not the user's
        raise ShardingError(f"internal: remat='auto' found no finite cut of the training graph ({e}); use "
                            f"remat='layers' or 'none' and please report this model") from None
    return {n for n in forward if n.op == "call_function" and (n, "in") in net and (n, "in") not in reached}


def recomputed(g: fx.Graph, forward: set[fx.Node], reads: set[fx.Node], fwd_outs: Sequence[Any], policy: str,
               sizes: Sequence[int]) -> set[fx.Node]:
    """Forward nodes of ``g`` (the set ``forward``) whose values the backward recomputes under ``policy``
    (see module doc) instead of reading them saved; ``reads``: the forward nodes the backward reads;
    ``sizes``: the mesh's axis sizes."""
    if policy == "layers":
        chosen = set().union(*layer_sets(g, forward, fwd_outs))
    elif policy == "auto":
        chosen = _min_cut(g, forward, reads, sizes)
    else:
        chosen = set()
    # an item of a multi-output op is recomputed only with the op: a tuple is never saved
    return {n for n in chosen if n.target is not operator.getitem or n.args[0] in chosen}


def fit_budget(policy: Policy, base: set[fx.Node], layers: list[set[fx.Node]],
               saved_bytes: Callable[[set[fx.Node]], int]) -> set[fx.Node]:
    """The recompute set under ``policy``'s budget: ``base`` (the policy's own choice) if what the forward
    then saves (``saved_bytes(recompute set)``) fits, else ``base`` plus the first ``k`` of ``layers`` for
    the smallest ``k`` that fits (see module doc); a ShardingError when none does."""
    budget = policy.budget
    if budget is None:
        return base
    limit = budget * saved_bytes(set()) if isinstance(budget, float) else budget
    chosen, smallest = set(base), saved_bytes(base)
    for k in range(len(layers) + 1):
        if k:
            chosen |= layers[k - 1]
            smallest = min(smallest, saved_bytes(chosen))
        if smallest <= limit:
            return chosen
    what = f"{budget:g} of what remat='none' saves ({fmt_bytes(limit)})" if isinstance(budget, float) else \
        fmt_bytes(limit)
    raise ShardingError(f"remat_budget: the forward saves at least {fmt_bytes(smallest)} per rank for the backward "
                        f"even with all {len(layers)} layers checkpointed, more than the budget of {what}; raise "
                        f"remat_budget, or split the activations over more ranks (in_specs, sequence parallelism)")
