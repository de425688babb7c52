"""The global planner's result written back: the chosen strategies of a :class:`~fxshard.planner.problem.Problem`
into the node meta propagate defines (``META_KEY``, ``IN_KEY``, ``STRATEGY_KEY``)."""

from __future__ import annotations

import operator

import torch.fx as fx

from ..plans.constrain import CONSTRAIN_OP
from ..core.context import ShardContext
from ..rules.registry import out_shape_of, strategy_specs, tensor_output_leaves
from ..core.ir import IN_KEY, META_KEY, STRATEGY_KEY
from .problem import Problem

__all__ = ["apply"]


def apply(gm: fx.GraphModule, ctx: ShardContext, problem: Problem, picks: dict[str, tuple[int, ...]]) -> None:
    """Write the chosen strategies into the node meta propagate defines, in graph order."""
    for node in gm.graph.nodes:
        if node.op == "output":
            req = list(node.meta.get(IN_KEY) or [])  # one per tensor leaf; ctx.out_required indexes every leaf
            for t, (j, leaf) in enumerate(tensor_output_leaves(node)[:len(req)]):
                if j >= len(ctx.out_required) or ctx.out_required[j] is None:
                    req[t] = leaf.meta[META_KEY].placements
            node.meta[IN_KEY] = req
            continue
        if node.op != "call_function":
            continue
        if node.target is operator.getitem and isinstance(node.args[0].meta.get(META_KEY), tuple):
            node.meta[META_KEY] = node.args[0].meta[META_KEY][node.args[1]]
            continue
        if node.name not in picks:
            continue
        chosen = [problem.nodes[node.name].axes[a][i] for a, i in enumerate(picks[node.name])]
        if node.target is CONSTRAIN_OP:
            lay = tuple(c.inputs[0] for c in chosen)
            node.meta[IN_KEY] = [lay]
            node.meta[META_KEY] = node.meta[META_KEY].with_placements(lay)
            continue
        strategies = [c.strategy for c in chosen]
        node.meta[STRATEGY_KEY] = tuple(strategies)
        node.meta[IN_KEY] = [tuple(st.inputs[i] for st in strategies) for i in range(len(strategies[0].inputs))]
        node.meta[META_KEY] = strategy_specs(node, strategies, out_shape_of(node))
