"""The state passes share: the mesh, seed placements, required output placements, warnings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from .mesh import MeshInfo
from .placements import Pl

__all__ = ["ShardContext", "runtime_device"]


@dataclass
class ShardContext:
    """Inputs to and notes from the pass pipeline.

    ``seeds`` maps placeholder nodes to their frozen placements (keyed by node, as the
    graph's meta is); ``out_required[i]`` is the placements output leaf ``i`` must
    have (None: whatever propagation chose). ``fallbacks`` lists ops computed
    replicated for lack of a rule. ``constraints`` maps ``fxshard::constrain`` keys to the
    placements they pin (None: axis left free). ``planner`` is ``"greedy"`` (propagate's sweep) or
    ``"global"`` (the solve pass re-plans the graph with a MILP; what ``shard``, ``jit`` and the CLI
    set by default; internal single-op contexts, such as rule validation, keep the sweep).
    ``bucket_mb`` is the gradient bucket size of backward programs in MiB (``passes/bucket.py``;
    None: one collective per gradient); ``bucketed`` the output leaves (numbered as ``out_required``) that are
    such gradients, empty without buckets (the global planner prices their last reduction's latency as a
    share of a bucket's).
    ``program_inputs``: while a backward program is finished, a function giving the fake local values of
    its first placeholders (what its forward saved, as the forward lays them out), for passes that model
    the program's memory (``passes/overlap.py``); None otherwise.
    ``activation_room``: set by auto-sharding under a memory budget, the bytes per rank its plan leaves
    for the graph's values; the global planner keeps their liveness peak within it (``auto.activation_rows``).
    """

    mesh: MeshInfo
    seeds: dict[fx.Node, tuple[Pl, ...]] = field(default_factory=dict)
    out_required: list[Optional[tuple[Pl, ...]]] = field(default_factory=list)
    constraints: dict[str, tuple[Optional[Pl], ...]] = field(default_factory=dict)
    fallbacks: list[str] = field(default_factory=list)
    label: str = "forward"
    planner: str = "greedy"
    bucket_mb: Optional[float] = None
    bucketed: frozenset = frozenset()  # indices into out_required: gradients the bucket pass packs
    activation_room: Optional[int] = None
    program_inputs: Optional[Callable[[], Sequence[Any]]] = None
    # auto-sharding's planner under ``activation_room`` (``auto.solve_within``; given by the caller so the
    # solve pass does not import auto, which imports it)
    solve_within: Optional[Callable] = None


def runtime_device(ctx: ShardContext) -> torch.device:
    """The device this rank's program runs on (the mesh's device type; this process's CUDA device)."""
    if ctx.mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(ctx.mesh.device_type)
