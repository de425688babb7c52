"""The front end ``fxshard.shard`` and ``fxshard.jit`` share, between tracing and the pipeline.

Tracing differs (a module through ``torch.export`` and, for training, a joint graph; a pure
function through ``make_fx``), what follows does not: both check that every rank shards the same
thing (:func:`check_consistent`), give every output leaf its required placements from
``out_specs`` (:func:`required_outputs`), and read the ``fxshard.constrain`` calls of the traced
graph (``tracing/annotate.py::constraint_table``) into the ShardContext (:func:`context_for`)
that the pipeline (``pipeline.py``) runs with.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx
from ..core.torch_compat import pytree

from ..comm.consistency import check_same_on_all_ranks, stable_repr
from ..core.context import ShardContext
from ..core.mesh import MeshInfo
from ..tracing.annotate import Leaf, check_divisible, constraint_table, spec_leaves
from ..core.placements import Pl
from ..plans.plan import to_placements
from ..rules.registry import output_leaves

__all__ = ["check_consistent", "required_outputs", "output_text", "context_for"]


def check_consistent(info: MeshInfo, in_specs: Any, out_specs: Any, program: dict[str, str]) -> None:
    """Raise the same ShardingError on every rank of the mesh when any of them has a mesh, specs or
    ``program`` description (named, comparable strings) different from the others' (a collective over
    the mesh's ranks only)."""
    check_same_on_all_ranks({"mesh": f"{dict(zip(info.names, info.sizes))} {info.links}",
                             "in_specs": stable_repr(in_specs),
                             "out_specs": stable_repr(out_specs), **program}, info)


def output_text(i: int, leaf: Any) -> str:
    """How errors name output leaf ``i``."""
    val = leaf.meta.get("val") if isinstance(leaf, fx.Node) else leaf
    if isinstance(val, torch.Tensor):
        return f"output {i} (a tensor of shape {list(val.shape)})"
    return f"output {i} ({type(val).__name__})"


def required_outputs(leaves: list[Any], out_tree: Any, out_specs: Any, mesh: MeshInfo,
                     even_why: Optional[str] = None) -> list[Optional[tuple[Pl, ...]]]:
    """Required placements per output leaf (``leaves``, the graph's flat outputs of structure ``out_tree``):
    ``out_specs`` (a spec pytree prefix of the outputs; None: replicated) per tensor leaf, None for
    non-tensors. ``even_why``, when given, requires split dims to divide and says why in the error."""
    struct = pytree.tree_unflatten([Leaf(output_text(i, leaf)) for i, leaf in enumerate(leaves)], out_tree)
    specs = spec_leaves(out_specs, struct, "out_specs") if out_specs is not None else [None] * len(leaves)
    paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(struct)[0]]
    req: list[Optional[tuple[Pl, ...]]] = []
    for leaf, spec, path in zip(leaves, specs, paths):
        val = leaf.meta.get("val") if isinstance(leaf, fx.Node) else None
        if not isinstance(val, torch.Tensor):  # a Python scalar (or None): the same on every rank
            req.append(None)
            continue
        pls = to_placements(spec, mesh, val.dim(), f"out_specs for output{path}")
        if even_why is not None:
            check_divisible(f"output{path} (shape {tuple(val.shape)})", tuple(val.shape), pls, mesh,
                            uneven=False, even_why=even_why)
        req.append(pls)
    return req


def graph_outputs(gm: fx.GraphModule) -> list[Any]:
    """The flat values ``gm`` returns."""
    return output_leaves(next(n for n in gm.graph.nodes if n.op == "output"))


def context_for(gm: fx.GraphModule, mesh: MeshInfo, seeds: dict[fx.Node, tuple[Pl, ...]],
                out_required: list[Optional[tuple[Pl, ...]]], constraints: dict[str, Any],
                label: str = "forward", planner: str = "global") -> ShardContext:
    """The pipeline's context for ``gm``: its seeds, required outputs, the placements its
    ``fxshard::constrain`` nodes pin (``constraints``: the specs recorded while tracing, by key) and
    the planner (``planner/solve.py``)."""
    return ShardContext(mesh=mesh, seeds=dict(seeds), out_required=list(out_required),
                        constraints=constraint_table(gm, mesh, constraints), label=label, planner=planner)
