"""Layer clustering for the global planner: decision nodes of identical repeated blocks share one set of
variables (docs/solver_design.md, "Layer clustering").

A joint graph has no module stack on its nodes, so blocks are found from the parameters: a placeholder
named ``p_<prefix>_<i>_<rest>`` (``p_layers_3_attention_wq_weight``) belongs to instance ``i`` of block
``<prefix>``, and every node to the instance of its nearest such ancestor (forward: the weights it is
computed from; backward: the weights and saved activations of the layer it differentiates). Then
colour refinement (Weisfeiler-Lehman), run until the partition is stable, gives each node a colour
from its own problem data (op, arguments, shapes, candidate strategies, legality pairs, work) and its
neighbours' colours; an edge to another instance contributes only the neighbour's own data and the
instance offset, so identical instances refine identically, while an instance whose surroundings
differ (the first, next to the embedding; the last, holding the head) gets colours of its own.
Decision nodes of one colour, one per instance, form a class.

Exact with respect to what it claims: members of a class have equal candidate lists (part of the
first colour), so sharing the representative's columns only adds "same strategy in every instance";
every instance's edges and compute are still priced (``solve._formulate``).
"""

from __future__ import annotations

import operator
import re
from collections import defaultdict
from typing import Optional

import torch.fx as fx

from ..plans.constrain import CONSTRAIN_OP

__all__ = ["block_instances", "node_classes", "refine"]

_INSTANCE = re.compile(r"^[pb]_(.+?)_(\d+)_.+$")
MAX_REFINE = 10_000  # refinement rounds; a stable partition is reached in at most |nodes| rounds


def block_instances(gm: fx.GraphModule) -> dict[str, tuple[str, int]]:
    """``node name -> (block prefix, instance index)``: the instance of the nearest repeated-block parameter
    among the node's ancestors (fewest edges; ties to the lower index, so every instance is labelled
    alike). Blocks with a single instance are left out; nodes with no such ancestor (the embedding, a
    mask or rope table every instance reads) belong to none."""
    seeds: dict[fx.Node, tuple[str, int]] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" and (m := _INSTANCE.match(n.name)):
            seeds[n] = (m.group(1), int(m.group(2)))
    count = defaultdict(set)
    for prefix, i in seeds.values():
        count[prefix].add(i)
    best: dict[fx.Node, tuple[int, str, int]] = {n: (0, *b) for n, b in seeds.items() if len(count[b[0]]) > 1}
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method", "call_module"):
            near = [best[x] for x in n.all_input_nodes if x in best]
            if near:
                d, prefix, i = min(near)
                best[n] = (d + 1, prefix, i)
    return {n.name: (prefix, i) for n, (_, prefix, i) in best.items()}


def node_classes(gm: fx.GraphModule, local: dict[str, object], decision: set[str]) -> dict[str, str]:
    """``member name -> representative name`` (the class's first node in graph order) for the nodes named in
    ``decision`` that share variables; nodes not listed keep their own.

    ``local[name]`` is a hashable summary of a node's problem data (a decision node's candidates per axis,
    legality pairs, work; a fixed value's layout): members of a class have equal summaries."""
    inst = block_instances(gm)
    colour = refine(gm, local, inst)
    groups: dict[int, list[fx.Node]] = defaultdict(list)
    for n in gm.graph.nodes:
        if n.name in decision and n.name in inst:
            groups[colour[n.name]].append(n)
    rep: dict[str, str] = {}
    for members in groups.values():
        if len(members) < 2 or len({inst[n.name] for n in members}) < len(members):
            continue  # two in one instance: no one-to-one map between instances
        for n in members[1:]:
            rep[n.name] = members[0].name
    return rep


def refine(gm: fx.GraphModule, local: dict[str, object], inst: dict[str, tuple[str, int]],
           rounds: int = MAX_REFINE) -> dict[str, int]:
    """Colour refinement until the partition is stable (or ``rounds``): ``node name -> colour``. A
    neighbour in the same instance (or both outside any) contributes its colour; one in another
    instance its first colour and the instance offset."""
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    index = {n: k for k, n in enumerate(nodes)}
    intern: dict[object, int] = {}
    c0 = [intern.setdefault(_own(n, local), len(intern)) for n in nodes]
    ins = [[index[x] for x in n.all_input_nodes] for n in nodes]
    outs: list[list[tuple[int, int]]] = [[] for _ in nodes]
    for k, n in enumerate(nodes):
        for slot, x in enumerate(n.all_input_nodes):
            outs[index[x]].append((k, slot))
    where = [inst.get(n.name) for n in nodes]
    tokens: dict[tuple, int] = {}

    def across(k: int, j: int) -> Optional[tuple[int, int]]:
        """How node ``k`` sees neighbour ``j`` when they are in different instances (None: same one)."""
        a, b = where[k], where[j]
        if a == b:
            return None
        seen = (c0[j], b) if a is None or b is None or a[0] != b[0] else (c0[j], b[1] - a[1])
        return (1, tokens.setdefault(seen, len(tokens)))

    cross_in = [[across(k, j) for j in ins[k]] for k in range(len(nodes))]
    cross_out = [[across(k, j) for j, _ in outs[k]] for k in range(len(nodes))]
    colour, n_colours = c0, len(set(c0))
    for _ in range(rounds):
        table: dict[tuple, int] = {}
        new = []
        for k in range(len(nodes)):
            sig = (colour[k],
                   tuple((0, colour[j]) if c is None else c for j, c in zip(ins[k], cross_in[k])),
                   tuple(sorted(((0, colour[j]) if c is None else c, s) for (j, s), c in zip(outs[k], cross_out[k]))))
            new.append(table.setdefault(sig, len(table)))
        colour = new
        if len(table) == n_colours:
            break
        n_colours = len(table)
    return {n.name: colour[k] for k, n in enumerate(nodes)}


def _own(n: fx.Node, local: dict[str, object]) -> tuple:
    """A node's own data, its neighbours left out (the first colour)."""
    val = n.meta.get("val")
    shape = tuple((str(tuple(v.shape)), v.dtype) if hasattr(v, "shape") else type(v).__name__
                  for v in (val if isinstance(val, (tuple, list)) else (val,)))
    if n.op == "placeholder":
        return ("placeholder", shape, local.get(n.name))
    if n.target is CONSTRAIN_OP:  # its argument names a constraint, whose layout the candidates hold
        return ("constrain", shape, local.get(n.name))
    args = repr(fx.node.map_arg((n.args, n.kwargs), lambda _: "%"))
    if n.target is operator.getitem:
        return ("getitem", args, shape)
    return (n.op, str(n.target), args, shape, local.get(n.name))
