"""``fxshard.shard``: the pass pipeline from a model to a per-rank ShardedModule."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils import _pytree as pytree

from .consistency import check_same_on_all_ranks, fingerprint
from .context import ShardContext
from .inputs import InputCheck
from .mesh import MeshInfo
from .checkpoint import rank_slices
from .module import Program, ShardedModule, Training
from .passes.annotate import annotate, spec_leaves
from .passes.emit import emit
from .passes.joint import partition, trace_joint
from .passes.localize import localize, runtime_device
from .passes.propagate import propagate
from .passes.redistribute import redistribute
from .passes.trace import Traced, trace_forward
from .placements import Pl, R
from .registry import output_leaves
from .plan import resolve_boundaries, resolve_plan, to_placements
from .spec import local_shape
from .symbolic import sym_shape

__all__ = ["shard", "PASSES", "run_passes"]

PASSES: list[Callable[[fx.GraphModule, ShardContext], fx.GraphModule]] = [propagate, redistribute, localize, emit]


def run_passes(gm: fx.GraphModule, ctx: ShardContext, verify: Optional[Callable] = None) -> fx.GraphModule:
    """Propagate, redistribute, localize and emit ``gm`` in place (``verify`` runs after each pass)."""
    for p in PASSES:
        gm = p(gm, ctx)
        if verify is not None:
            verify(gm, ctx, p.__name__)
    return gm


def _out_required(traced: Traced, out_specs: Any, mesh: MeshInfo,
                  param_pls: dict[str, tuple[Pl, ...]]) -> list[Optional[tuple[Pl, ...]]]:
    """Required placements per output leaf: buffer updates keep their buffer's layout, user outputs
    follow ``out_specs``."""
    out_node = next(n for n in traced.gm.graph.nodes if n.op == "output")
    leaves = output_leaves(out_node)
    n_mut = len(traced.mutations)
    req: list[Optional[tuple[Pl, ...]]] = [param_pls.get(b, (R,) * len(mesh.sizes)) for b in traced.mutations]
    user = leaves[n_mut:]
    struct = pytree.tree_unflatten(list(range(len(user))), traced.out_tree)
    specs = spec_leaves(out_specs, struct, "out_specs") if out_specs is not None else [None] * len(user)
    for i, (leaf, spec) in enumerate(zip(user, specs)):
        val = leaf.meta.get("val") if isinstance(leaf, fx.Node) else None
        if isinstance(val, torch.Tensor):
            req.append(to_placements(spec, mesh, val.dim(), f"out_specs for output {i}"))
        else:
            req.append(None)
    return req


def shard(model: nn.Module, mesh: DeviceMesh, plan: Optional[Mapping[str, Any]] = None, *,
          example_inputs: Sequence[Any] = (), example_kwargs: Optional[dict] = None, in_specs: Any = None,
          out_specs: Any = None, dynamic_shapes: Any = None,
          progress: Optional[Callable[[str], None]] = None) -> ShardedModule:
    """Shard ``model`` over ``mesh`` following ``plan``; returns this rank's ShardedModule.

    Requires: ``example_inputs`` with global shapes (any device; meta works), a
    plan of FQN globs -> ``P(...)``/placements (parameters, buffers) or
    ``ColwiseParallel()``/``RowwiseParallel()`` (nn.Linear/nn.Embedding
    modules); ``in_specs`` a spec pytree prefix of ``example_inputs`` (default
    replicated) and ``out_specs`` one of the outputs (default replicated).
    Ensures: the module's parameters are local shards under the original
    FQNs, and its forward on each rank's local inputs returns the local part
    of what ``model`` returns on the global inputs. Plan errors raise
    ShardingError before tracing. ``progress``, if given, is called with a short
    message as each stage starts (tracing a large model takes a while).
    """
    say = progress or (lambda msg: None)
    info = MeshInfo.of(mesh)
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    check_same_on_all_ranks(fingerprint(plan, model, info, example_inputs, in_specs, out_specs))
    say("checking the plan")
    param_pls = resolve_plan(plan, model, info)
    say("tracing the forward (torch.export)")
    traced = trace_forward(model, example_inputs, kwargs, dynamic_shapes, resolve_boundaries(plan, model, info))
    ctx = annotate(traced, info, param_pls, example_inputs, kwargs, in_specs, _out_required(traced, out_specs, info, param_pls))

    placements: dict[str, tuple[Pl, ...]] = {}
    shapes: dict[str, tuple] = {}
    placeholders = [n for n in traced.gm.graph.nodes if n.op == "placeholder"]
    for node, slot in zip(placeholders, traced.slots):
        for name in slot.names if slot.kind in ("param", "buffer") else ():
            placements[name] = ctx.seeds[node.name]
            shapes[name] = sym_shape(node.meta["val"])
    ins = [(slot.index, node) for node, slot in zip(placeholders, traced.slots) if slot.kind == "input"]
    k = len(info.sizes)
    check = InputCheck.from_placeholders([i for i, _ in ins], [n.meta.get("val") for _, n in ins],
                                         [ctx.seeds.get(n.name, (R,) * k) for _, n in ins], info)

    leaves = pytree.tree_leaves((tuple(example_inputs), kwargs))
    wants_grad = [
        (slot.kind == "param" and slot.requires_grad)
        or (slot.kind == "input" and leaves[traced.tensor_leaf_positions[slot.index]].requires_grad)
        for slot in traced.slots
    ]
    training = None
    if any(wants_grad):
        training = _shard_training(traced, ctx, wants_grad, say)
    say("sharding the inference program")
    gm = run_passes(traced.gm, ctx)
    say("allocating local shards")
    tensors = _local_tensors(model, traced, placements, mesh, runtime_device(ctx))
    return ShardedModule(traced, Program(gm, "forward", list(ctx.fallbacks)), training, mesh, info, placements,
                         shapes, tensors, check)


def _shard_training(traced: Traced, ctx: ShardContext, wants_grad: list[bool],
                    say: Callable[[str], None]) -> Training:
    """Trace the joint graph from the still-global forward, shard it with the forward's seeds, split it."""
    say("tracing forward + backward (joint graph)")
    joint = trace_joint(traced, traced.gm, wants_grad)
    fwd_ph = [n for n in traced.gm.graph.nodes if n.op == "placeholder"]
    joint_ph = [n for n in joint.gm.graph.nodes if n.op == "placeholder"]
    jctx = ShardContext(mesh=ctx.mesh, label="training", constraints=dict(ctx.constraints))
    for f, j in zip(fwd_ph, joint_ph):
        if f.name in ctx.seeds:
            jctx.seeds[j.name] = ctx.seeds[f.name]
    k = len(ctx.mesh.sizes)
    for t, i in zip(joint_ph[joint.n_primals:], joint.diff_out):
        jctx.seeds[t.name] = ctx.out_required[i] or (R,) * k
    jctx.out_required = list(ctx.out_required) + [ctx.seeds.get(fwd_ph[i].name) for i in joint.diff_in]
    say(f"sharding the training program ({len(joint.gm.graph.nodes)} nodes)")
    gm = run_passes(joint.gm, jctx)
    split = partition(joint, gm)
    fb = list(jctx.fallbacks)
    updated = [i for i, slot in enumerate(traced.slots) if slot.kind == "buffer" and set(slot.names) & set(traced.mutations)]
    return Training(Program(split.fwd, "forward", fb), Program(split.bwd, "backward", fb), joint.n_out,
                    joint.diff_out, joint.diff_in, updated)


def _local_tensors(model: nn.Module, traced: Traced, placements: dict, mesh: DeviceMesh,
                   device: torch.device) -> dict[str, torch.Tensor]:
    """Local shards of every parameter/buffer, sliced from the model's tensors (meta: uninitialized)."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(dict(model.named_buffers(remove_duplicate=False)))
    out: dict[str, torch.Tensor] = {}
    coords = MeshInfo.of(mesh).coords
    for slot in traced.slots:
        if slot.kind not in ("param", "buffer"):
            continue
        name = slot.names[0]
        full = named[name]
        pls = placements[name]
        if full.device.type == "meta" and dist.is_initialized() and dist.get_backend() == "fake":
            # planning on the fake process group: shards stay on meta (nothing can run anyway)
            shape = [int(s) for s in local_shape(tuple(full.shape), pls, tuple(mesh.shape), coords)]
            local = torch.empty(shape, dtype=full.dtype, device="meta")
        elif full.device.type == "meta":
            shape = [int(s) for s in local_shape(tuple(full.shape), pls, tuple(mesh.shape), coords)]
            local = torch.empty(shape, dtype=full.dtype, device=device)
        else:
            # slice where the full tensor lives, then move only the shard (no full copy on this rank's device)
            local = full.detach()[rank_slices(tuple(full.shape), pls, MeshInfo.of(mesh))].to(device).clone()
        out[name] = nn.Parameter(local, requires_grad=full.requires_grad) if slot.kind == "param" else local
    return out
