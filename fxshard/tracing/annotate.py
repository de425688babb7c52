"""Pass 2, annotate: turn the plan and in/out specs into seed placements.

Requires: a Traced program and placements per planned FQN (``plan.resolve_plan``).
Ensures: a ShardContext whose seeds hold the placements of every placeholder
(parameters/buffers from the plan, user inputs from ``in_specs``, everything
else replicated) and whose ``out_required`` holds one entry per flattened
output leaf. A split dim that does not divide raises a ShardingError naming
the tensor, dim, size and axis.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from ..core.torch_compat import pytree

from ..core.context import ShardContext
from ..core.errors import ShardingError
from ..core.mesh import MeshInfo
from ..core.placements import Pl, R
from ..plans.constrain import CONSTRAIN_OP
from ..plans.plan import check_divisible, constraint_placements, is_spec_leaf, to_placements
from ..core.symbolic import sym_shape
from ..core.ir import source_line
from .export import Traced

__all__ = ["annotate", "spec_leaves", "check_divisible", "constraint_table", "Leaf"]


class Leaf:
    """Stands for one value in a structure that specs are matched against (its text names it in errors)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _value_text(v: Any) -> str:
    if isinstance(v, Leaf):
        return v.text
    if isinstance(v, torch.Tensor):
        return f"a tensor of shape {list(v.shape)}"
    if isinstance(v, (tuple, list)):
        return f"a {type(v).__name__} of {len(v)} values"
    if isinstance(v, dict):
        return f"a dict with keys {list(v)}"
    return f"a {type(v).__name__}"


def spec_leaves(specs: Any, values: Any, what: str) -> list[Any]:
    """Broadcast a spec pytree prefix over ``values``; one spec (or None) per pytree leaf of ``values``."""
    if specs is None or is_spec_leaf(specs):
        return [specs] * len(pytree.tree_leaves(values))
    if isinstance(values, (tuple, list)) and isinstance(specs, (tuple, list)):
        if len(specs) != len(values):
            raise ShardingError(
                f"{what}: {len(specs)} specs given for {_value_text(values)}; give one spec (or None) per value"
            )
        return [s for sp, v in zip(specs, values) for s in spec_leaves(sp, v, what)]
    if isinstance(values, dict) and isinstance(specs, dict):
        extra = set(specs) - set(values)
        if extra:
            raise ShardingError(f"{what}: specs for unknown keys {sorted(extra)}; the keys are {sorted(values)}")
        return [s for k, v in values.items() for s in spec_leaves(specs.get(k), v, what)]
    kind = "tuple/list" if isinstance(specs, (tuple, list)) else "dict" if isinstance(specs, dict) else ""
    shape = f"a {kind} of specs describes a {kind} of values" if kind else f"{specs!r} is not a spec"
    raise ShardingError(
        f"{what}: spec {specs!r} does not fit {_value_text(values)}: {shape}; give one spec (P(...), placements or "
        f"None) for each tensor, or a tuple/list/dict of specs shaped like the values"
    )


def annotate(traced: Traced, mesh: MeshInfo, param_pls: dict[str, tuple[Pl, ...]], args: tuple, kwargs: dict,
             in_specs: Any, out_required: list[Optional[tuple[Pl, ...]]], label: str = "forward",
             constraints: Optional[dict[str, Any]] = None) -> ShardContext:
    """See module doc; ``constraints`` holds the specs ``fxshard.constrain`` recorded while tracing
    (``constrain.constraint_scope``), by key."""
    ctx = ShardContext(mesh=mesh, label=label)
    placeholders = [n for n in traced.gm.graph.nodes if n.op == "placeholder"]
    if kwargs and isinstance(in_specs, tuple) and len(in_specs) == 2 and isinstance(in_specs[1], dict):
        # with keyword inputs, in_specs may be (specs for args, {name: spec}) covering both
        flat_in = spec_leaves((tuple(in_specs[0]) if isinstance(in_specs[0], (tuple, list)) else in_specs[0],
                               in_specs[1]), (tuple(args), dict(kwargs)), "in_specs")
    else:
        flat_in = spec_leaves(in_specs, tuple(args), "in_specs") if in_specs is not None else None
    for node, slot in zip(placeholders, traced.slots):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        if slot.kind in ("param", "buffer"):
            chosen = {param_pls[n] for n in slot.names if n in param_pls}
            if len(chosen) > 1:
                raise ShardingError(
                    f"{' and '.join(slot.names)} are one tied tensor but the plan places them differently "
                    f"({', '.join(map(str, chosen))}); give tied names the same spec"
                )
            pls = chosen.pop() if chosen else (R,) * len(mesh.sizes)
            check_divisible(slot.names[0], sym_shape(val), pls, mesh)
        elif slot.kind == "input":
            leaf_pos = traced.tensor_leaf_positions[slot.index]
            spec = flat_in[leaf_pos] if flat_in is not None and leaf_pos < len(flat_in) else None
            what = f"in_specs for input {slot.index}"
            pls = to_placements(spec, mesh, val.dim(), what)
            check_divisible(f"input {slot.index} (shape {tuple(sym_shape(val))})", sym_shape(val), pls, mesh)
        else:
            pls = (R,) * len(mesh.sizes)
        ctx.seeds[node] = pls
    ctx.out_required = list(out_required)
    ctx.constraints = constraint_table(traced.gm, mesh, constraints or {})
    return ctx


def constraint_table(gm: Any, mesh: MeshInfo, specs: dict[str, Any]) -> dict[str, tuple[Optional[Pl], ...]]:
    """The placements each ``fxshard::constrain`` node of ``gm`` pins, by its key (``ShardContext.constraints``);
    ``specs`` are the specs recorded while tracing ``gm``, by key."""
    table = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is CONSTRAIN_OP:
            key = node.args[1]
            if key not in specs:
                raise ShardingError(f"internal: the constraint {key} at {source_line(node) or node.name} was not "
                                    f"recorded while tracing; please report this model")
            table[key] = constraint_placements(
                specs[key], mesh, node.meta["val"].dim(), f"constraint at {source_line(node) or node.name}")
    return table
