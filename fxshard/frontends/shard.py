"""``fxshard.shard``: the pass pipeline from a model to a per-rank ShardedModule."""

from __future__ import annotations

import copy
import functools
import gc
import itertools
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from ..core.torch_compat import pytree

from ..planner.auto import RETRIES, AutoReport, complete_plan, measure, next_margin, parse_budget, solve_within
from ..analysis.liveness import output_values, remembering_values
from ..report.memory import memory as memory_report
from ..core.sizes import fmt_bytes
from ..comm.consistency import check_generators_agree, fingerprint
from ..planner.cost import linked_mesh_info
from ..plans.constrain import constraint_scope
from ..core.context import ShardContext
from ..plans.hf import from_hf
from ..runtime.inputs import InputCheck
from ..report.inspect import gathered_input_note, gathered_inputs
from ..core.mesh import MeshInfo
from ..state.checkpoint import take
from ..core.errors import ShardingError
from ..tracing.captured import forward_scalars, settled_after_trace
from ..runtime.programs import Program, Programs, Training, Untrainable
from ..runtime.sharded_module import ShardedModule
from ..runtime.state_interop import named_tensors
from ..comm.replicas import check_replicas, communicates, from_source, sentinel
from ..core.context import runtime_device
from .common import check_consistent, graph_outputs, required_outputs
from ..tracing.annotate import annotate
from ..passes.bucket import DEFAULT_BUCKET_MB
from ..tracing.joint import CollectiveGradient, joint_context, partition, trace_joint
from ..planner.solve import PLANNERS
from ..tracing.export import Traced, trace_forward
from ..passes.pipeline import DEFAULT, Pipeline
from ..core.progress import Progress, reporter
from ..tracing.remat import Policy, check_policy
from ..core.placements import Pl, R
from ..core.precision import REDUCE_DTYPE, AutocastState, autocast_off, describe
from ..plans.plan import resolve_boundaries, resolve_plan
from ..runtime.sources import Layout, is_blank, remember, settle, shard_tracing, shared_local
from ..core.spec import local_shape
from ..core.symbolic import sym_shape
from ..core.torch_compat import LazyGraphModule as _LazyGraphModule, use_lazy_graph_module as _use_lazy_graph_module

__all__ = ["shard"]


def shard(model: nn.Module, mesh: DeviceMesh, plan: Optional[Mapping[str, Any] | str] = None, *,
          example_inputs: Sequence[Any] = (), example_kwargs: Optional[dict] = None, in_specs: Any = None,
          out_specs: Any = None, dynamic_shapes: Any = None, src_data_rank: Optional[int] = 0,
          bucket_mb: Optional[float] = DEFAULT_BUCKET_MB, planner: str = "global", remat: str = "none",
          remat_budget: Union[int, float, str, None] = None, auto: bool = False,
          memory_budget: Union[int, float, str, None] = None, bandwidth: Optional[Mapping[str, float]] = None,
          latency: Optional[Mapping[str, float]] = None, progress: Progress = None,
          pipeline: Pipeline = DEFAULT) -> ShardedModule:
    """Shard ``model`` over ``mesh`` following ``plan``; returns this rank's ShardedModule.

    Requires: ``example_inputs`` with global shapes (any device; meta works), a
    plan of FQN globs -> ``P(...)``/placements (parameters, buffers) or
    ``ColwiseParallel()``/``RowwiseParallel()`` (nn.Linear/nn.Embedding
    modules), or ``"hf"`` for a transformers model's own plan (``fxshard.from_hf``);
    ``in_specs`` a spec pytree prefix of ``example_inputs`` (default
    replicated) and ``out_specs`` one of the outputs (default replicated).
    Ensures: the module's parameters are local shards under the original
    FQNs, and its forward on each rank's local inputs returns the local part
    of what ``model`` returns on the global inputs. Plan errors raise
    ShardingError before tracing. ``progress`` reports each stage as it starts (tracing a
    large model takes a while): by default on stderr when it is a terminal (rank 0 only), a
    callable gets the messages, ``False`` silences it (``fxshard.core.progress.reporter``).
    ``pipeline`` is the pass pipeline (``fxshard.passes.pipeline``). ``DEFAULT`` ends by scheduling each
    program's collectives for overlap (issued as soon as their inputs exist, waited when nothing
    independent is left to run) where that raises the program's modelled peak memory by at most 1%;
    ``DEFAULT.without("overlap")`` keeps each collective right before its first consumer.
    ``planner``: ``"global"`` (default) chooses every op's strategy by one MILP over the whole graph
    (HiGHS via scipy, ``planner/solve.py``), seeded by the greedy sweep and never costlier than its plan;
    where the greedy plan is provably optimal (e.g. Megatron styles pinning every layout around the
    matmuls) the MILP is skipped (``certificate.greedy_is_optimal``). ``"greedy"`` keeps the sweep's plan: one
    pass in graph order, no solver (faster on large graphs; it cannot see that a locally cheap choice
    costs more later, e.g. under FSDP x tensor-parallel plans).

    Link speeds: both planners minimise communication time in the alpha-beta model. By default an axis
    whose process groups span nodes (torchrun's ``LOCAL_WORLD_SIZE``) gets ``cost.INTER_NODE`` bytes/s and
    one inside a node ``cost.INTRA_NODE``; on one node every axis is alike (time = bytes moved).
    ``bandwidth`` (bytes/s) and ``latency`` (s per collective) per axis name override it, e.g.
    ``bandwidth={"tp": 300e9, "dp": 25e9}``, so the plans move their bytes on the fast axis where they
    can (``cost.links``).

    Auto-sharding: ``auto=True`` completes ``plan`` (down to an empty one): every parameter it does
    not place is replicated or split on a mesh axis (tensor-parallel, or FSDP-style: stored split,
    gathered before use) as one MILP finds cheapest in communication with the per-rank footprint
    within ``memory_budget`` (bytes per rank, or a string like ``"8GiB"``): parameters, gradients,
    AdamW state (two fp32 values per element) and an activation peak estimate (``fxshard/planner/auto.py``).
    What the plan places stays as given; ``explain()`` lists the chosen entries and what each saves
    (``sm.sharding.auto``). No plan within the budget is a ShardingError giving the smallest footprint.

    Gradient communication: as in DDP, the backward's gradient all-reduces (reduce-scatters under
    FSDP-style specs) are packed into buckets of at most ``bucket_mb`` MiB (default 25, DDP's
    ``bucket_cap_mb``), each issued as soon as its last gradient is computed, so it overlaps the
    rest of the backward; ``bucket_mb=None`` issues one collective per gradient at the end.

    Activation checkpointing: ``remat`` is the policy by which the training program's partition trades
    saved activations for recomputation in the backward (``fxshard.tracing.remat``): ``"none"`` (default) saves
    every activation the backward reads, ``"layers"`` recomputes each layer's forward (an element of a
    ``ModuleList``/``Sequential``) in its backward from the layer's saved input, ``"auto"`` recomputes
    cheap elementwise ops and views where that lowers the saved bytes (a min-cut). Random draws are never
    recomputed: gradients are those of ``"none"``. ``fxshard.memory(sm)["saved"]`` reports the result.
    ``remat_budget`` (with ``"auto"`` or ``"layers"``) bounds the saved activations per rank, in bytes
    (``"2GiB"`` works) or as a float in ``(0, 1]``, a fraction of what ``"none"`` saves: whole layers
    are checkpointed too, first layers first, as few as fit (a budget nothing meets is a ShardingError).

    Values: as with torch's ParallelStyles, every parameter and buffer comes from rank
    ``src_data_rank`` (default 0; a coordinate on every mesh axis): each full tensor is broadcast
    from it, one at a time, and every rank keeps its slice, so an unseeded model gives the result
    of the unsharded model on that rank. ``src_data_rank=None`` keeps each rank's own values (no
    communication) and raises a ShardingError naming any replicated value that differs between
    ranks. A model built on the meta device has no values yet: fill the result with
    ``init_parameters``, ``load_full_state_dict``, a DCP load or in-place writes; calling it
    before raises a ShardingError naming what was never filled.

    Modes: the programs are traced in the modes (``training`` flags) ``model``'s submodules
    have now. ``sm.train()``/``sm.eval()`` (or a submodule's) are followed as in eager: the first
    call in a new combination of modes traces and shards again for it (on every rank: all ranks
    must switch together), and the programs are cached per combination.

    Mixed precision: called inside ``torch.autocast`` (for the mesh's device type), the programs are traced
    inside it and compute as eager does under it: parameters, their gradients and the optimizer state keep
    the model's dtypes (float32 master weights), the ops autocast lowers run in its dtype, its casts are
    nodes of the programs. A Partial sum of a narrower float (a row-split bf16 matmul's output) is reduced
    in float32 and cast back, as one matmul accumulates; gradients of float32 parameters are reduced in
    float32. The module must then be called inside the same autocast (dtype and ``cache_enabled`` alike), and
    one sharded outside autocast must be called outside it: a ShardingError says which.
    """
    autocast = AutocastState.current(mesh.device_type)
    say = reporter(progress)
    plan = from_hf(model) if isinstance(plan, str) and plan == "hf" else plan
    info = linked_mesh_info(mesh, bandwidth, latency)
    if autocast is not None:
        info = replace(info, reduce_dtype=REDUCE_DTYPE)
    if src_data_rank is not None and (not isinstance(src_data_rank, int) or not all(
            0 <= src_data_rank < n for n in info.sizes)):
        raise ShardingError(f"src_data_rank={src_data_rank!r} is not a coordinate on every axis of the mesh "
                            f"{dict(zip(info.names, info.sizes))}; pass an int below {min(info.sizes)} (default 0), "
                            f"or None to keep each rank's own values")
    if bucket_mb is not None and (isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float))
                                  or not bucket_mb >= 0):
        raise ShardingError(f"bucket_mb={bucket_mb!r} is not a bucket size; pass a number of MiB >= 0 (default "
                            f"{DEFAULT_BUCKET_MB:g}, as DDP's bucket_cap_mb), or None for one collective per gradient")
    remat = check_policy(remat, remat_budget)
    if planner not in PLANNERS:
        raise ShardingError(f"planner={planner!r} is not a planner; use one of {PLANNERS} (default 'global')")
    budget = parse_budget(memory_budget)
    if budget is not None and not auto:
        raise ShardingError(f"memory_budget={memory_budget!r} is used by auto-sharding only; pass auto=True to let "
                            f"fxshard complete the plan within it, or drop memory_budget")
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    req = _Request(plan, example_inputs, dict(example_kwargs or {}), in_specs, out_specs, dynamic_shapes, pipeline,
                   bucket_mb, planner, remat, auto, budget, autocast=autocast)
    captured = forward_scalars(model)
    for attempt in range(RETRIES + 1):
        progs, placements, shapes, runtime, report = _shard_programs(model, info, req, say)
        captured = settled_after_trace(captured, f"{type(model).__name__}'s forward, while traced,")
        keep = req
        if report is not None:  # sharding again for other modes keeps the chosen plan
            keep = replace(req, plan={**dict(plan or {}), **{e.fqn: e.placements for e in report.chosen}}, auto=False,
                           planner=req.planner or "global")
        say("allocating local shards")
        tensors, unfilled, origins = _local_tensors(model, progs.traced, placements, mesh, runtime, src_data_rank)
        modules = _module_tree(model)
        reshard, train_override = (None, None) if getattr(model, "fxshard_fixed_modes", False) else \
            _resharder(model, info, keep, placements, say, dict(progs.traced.constants))
        sm = ShardedModule(progs, mesh=mesh, info=info, placements=placements, global_shapes=shapes, tensors=tensors,
                           modules=modules, name=type(model).__name__, src_data_rank=src_data_rank, unfilled=unfilled,
                           reshard=reshard, train_override=train_override, auto=report, captured=captured,
                           autocast=autocast)
        if report is None:
            break
        sm.fxshard_state.auto = measure(report, memory_report(sm, "adamw"), last=attempt == RETRIES)
        margin = next_margin(sm.fxshard_state.auto)
        if margin is None:
            break
        say(f"auto: the result needs {fmt_bytes(sm.fxshard_state.auto.measured)} per rank, over the budget; planning "
            f"again against {fmt_bytes(req.budget - margin)}")
        req = replace(req, margin=margin)
    remember(sm, origins, model, unfilled)
    _warn_gathered_inputs(sm)
    if src_data_rank is None:
        check_replicas(named_tensors(sm), placements, mesh,
                       "src_data_rank=None keeps each rank's own values: seed every rank the same before building "
                       "the model or load the same checkpoint on every rank, or leave src_data_rank=0 (the default) "
                       "to copy rank 0's values")
    return sm


def _warn_gathered_inputs(sm: ShardedModule) -> None:
    """Warn (once per input and axis) when an input split by ``in_specs`` is all-gathered before use, so every
    rank computes with all of it: a batch split on ``dp`` with the default replicated ``out_specs`` looks like
    data parallelism but computes the whole batch on every rank (``inspect.gathered_inputs``)."""
    for g in gathered_inputs(sm.sharding):
        warnings.warn(f"fxshard.shard: {gathered_input_note(g)}", stacklevel=3)


@dataclass
class _Request:
    """What ``shard()`` was asked for, kept to shard the model again for other modes."""

    plan: Optional[Mapping[str, Any]]
    example_inputs: tuple
    kwargs: dict
    in_specs: Any
    out_specs: Any
    dynamic_shapes: Any
    pipeline: Pipeline = DEFAULT
    bucket_mb: Optional[float] = DEFAULT_BUCKET_MB
    planner: str = "global"
    remat: Policy = Policy()
    auto: bool = False
    budget: Optional[int] = None
    margin: int = 0  # auto plans against budget - margin (after a result measured over the budget)
    autocast: Optional[AutocastState] = None  # the forward is traced inside it (precision.py)

    @property
    def buckets_mb(self) -> Optional[float]:
        """``bucket_mb`` when the pipeline runs the bucket pass, else None: what the planners price."""
        return self.bucket_mb if "bucket" in self.pipeline.names else None


def _module_tree(model: nn.Module) -> list[tuple[str, type, bool, str, dict[str, Any]]]:
    """``(fqn, type, training, first fqn of the same module, its plain attributes)`` per submodule, in
    pre-order; the plain attributes (name -> value: neither tensors nor modules nor ``_``-names, e.g. a dropout's
    ``p``) are constants to the trace."""
    first: dict[int, str] = {}
    return [(fqn, type(m), m.training, first.setdefault(id(m), fqn),
             {k: v for k, v in vars(m).items() if not k.startswith("_") and k != "training"
              and not isinstance(v, (torch.Tensor, nn.Module))})
            for fqn, m in model.named_modules(remove_duplicate=False)]


_GC_YOUNG = 50_000  # allocations between young-generation collections while sharding (Python's default: 700)
# what the interpreter froze before fxshard (Python 3.12.1 starts with 375 objects frozen; 3.11 and 3.13 with none)
_FROZEN_AT_IMPORT = gc.get_freeze_count()


def _shard_programs(model: nn.Module, info: MeshInfo, req: _Request, say: Callable[[str], None]
                    ) -> tuple[Programs, dict[str, tuple[Pl, ...]], dict[str, tuple], torch.device, Optional[AutoReport]]:
    """Trace ``model`` in its current modes and shard every program (a collective: the consistency check);
    with ``req.auto``, the plan is completed first (the report; None otherwise).

    Graph modules are lazy while tracing and passes rewrite them (each ``recompile`` only marks the
    code stale; generating Python for a 10k-node graph takes a tenth of a second, dozens of times
    over); the finished programs' code is generated once, here. The objects alive before the call
    (torch's own, the model) are frozen out of the garbage collector meanwhile, so its full
    collections scan only what sharding allocates (unless the caller froze some since fxshard was imported:
    Python 3.12 starts with a few hundred objects of its own frozen, which count as none), and the
    youngest generation is collected every ``_GC_YOUNG`` allocations instead of 700: tracing allocates
    millions of objects, nearly all kept (graph nodes, fake tensors), so frequent young collections found
    little and promoted into the full ones (~9% of shard() at 8B x 32 layers).
    """
    freeze = gc.isenabled() and gc.get_freeze_count() <= _FROZEN_AT_IMPORT
    if freeze:
        gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(max(thresholds[0], _GC_YOUNG), *thresholds[1:])
    try:
        with _use_lazy_graph_module(True), shard_tracing(), autocast_off(info.device_type):
            out = _shard_programs_lazily(model, info, req, say)
    finally:
        gc.set_threshold(*thresholds)
        if freeze:
            gc.unfreeze()
    progs = out[0]
    programs = (progs.forward,) + ((progs.training.fwd, progs.training.bwd) if progs.training else ())
    for prog in programs:
        _LazyGraphModule.force_recompile(prog.gm)
    check_generators_agree(info, f"{type(model).__name__}'s sharded program", [prog.gm for prog in programs])
    return out


def _shard_programs_lazily(model: nn.Module, info: MeshInfo, req: _Request, say: Callable[[str], None]
                           ) -> tuple[Programs, dict[str, tuple[Pl, ...]], dict[str, tuple], torch.device, Optional[AutoReport]]:
    example_inputs, kwargs = req.example_inputs, req.kwargs
    check_consistent(info, req.in_specs, req.out_specs,
                     {**fingerprint(req.plan, model, example_inputs), "planner": req.planner,
                      "autocast": describe(req.autocast, info.device_type)})
    say("checking the plan")
    param_pls = resolve_plan(req.plan, model, info)
    say("tracing the forward (torch.export)")
    with constraint_scope() as recorded:
        traced = trace_forward(model, example_inputs, kwargs, req.dynamic_shapes,
                               resolve_boundaries(req.plan, model, info), autocast=req.autocast)
    # buffer updates (the first outputs) keep their buffer's layout; user outputs follow out_specs
    k = len(info.sizes)
    out_required = [param_pls.get(b, (R,) * k) for b in traced.mutations] + required_outputs(
        graph_outputs(traced.gm)[len(traced.mutations):], traced.out_tree, req.out_specs, info)
    ctx = annotate(traced, info, param_pls, example_inputs, kwargs, req.in_specs, out_required,
                   constraints=recorded)
    leaves = pytree.tree_leaves((tuple(example_inputs), kwargs))
    wants_grad = [
        (slot.kind == "param" and slot.requires_grad)
        or (slot.kind == "input" and leaves[traced.tensor_leaf_positions[slot.index]].requires_grad)
        for slot in traced.slots
    ]
    report = None
    if req.auto:
        say("choosing the placements the plan leaves out (auto)")
        param_pls, report = complete_plan(traced, ctx, param_pls, wants_grad, req.budget, req.margin, req.buckets_mb)
        ctx = annotate(traced, info, param_pls, example_inputs, kwargs, req.in_specs, out_required,
                       constraints=recorded)
        if report is not None and req.budget is not None:  # the planner keeps the values within what is left
            ctx.activation_room = req.budget - req.margin - (report.footprint - report.activation_peak)
            # re-planned from the plan the layouts were chosen with (solve_within's hint)
            ctx.solve_within = functools.partial(solve_within, hint=report.strategies)
    ctx.planner = req.planner

    placements: dict[str, tuple[Pl, ...]] = {}
    shapes: dict[str, tuple] = {}
    placeholders = [n for n in traced.gm.graph.nodes if n.op == "placeholder"]
    for node, slot in zip(placeholders, traced.slots):
        for name in slot.names if slot.kind in ("param", "buffer") else ():
            placements[name] = ctx.seeds[node]
            shapes[name] = sym_shape(node.meta["val"])
    ins = [(slot.index, node) for node, slot in zip(placeholders, traced.slots) if slot.kind == "input"]
    check = InputCheck.from_placeholders([i for i, _ in ins], [n.meta.get("val") for _, n in ins],
                                         [ctx.seeds.get(n, (R,) * k) for _, n in ins], info)

    training = untrainable = None
    if any(wants_grad):
        try:
            training = _shard_training(traced, ctx, wants_grad, say, req.pipeline, req.buckets_mb, req.remat)
        except CollectiveGradient as e:  # as in eager, only a backward through the model's own collective fails
            untrainable = Untrainable(e, [i for i, w in enumerate(wants_grad) if w])
    say("sharding the inference program")
    gm = req.pipeline(traced.gm, ctx)
    progs = Programs(traced, Program(gm, "forward", list(ctx.fallbacks)), training, check, untrainable)
    return progs, placements, shapes, runtime_device(ctx), report


def _meta_like(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x, device="meta").requires_grad_(x.requires_grad)
    return x


def _tensor_attributes(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain tensor attributes of ``model`` (``self.w = torch.ones(3)``, neither parameter nor buffer;
    traced as constants named by their FQN), by FQN."""
    return {f"{prefix}.{k}" if prefix else k: v for prefix, m in model.named_modules()
            for k, v in vars(m).items() if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)}


def _skeleton(model: nn.Module, attributes: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of ``model`` whose parameters, buffers and plain tensor attributes (``attributes``, from
    ``_tensor_attributes``) live on the meta device (no data is copied), except 0-dim attributes: a CPU scalar
    computes with meta tensors, and ``float(self.t)`` needs its value."""
    memo: dict[int, Any] = {}
    attrs = (v for v in attributes.values() if v.dim() > 0)
    for t in itertools.chain(model.parameters(), model.buffers(), attrs):
        if id(t) not in memo:
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


TrainOverride = Callable[[str, bool, dict[str, bool], dict[str, bool]],
                         Optional[tuple[dict[str, bool], dict[str, bool]]]]


def _resharder(model: nn.Module, info: MeshInfo, req: _Request, placements: dict[str, tuple[Pl, ...]],
               progress: Optional[Callable[[str], None]], constants: dict[str, Any]
               ) -> tuple[Callable[[dict[str, bool], dict[str, bool]], Programs], TrainOverride]:
    """Two functions over one meta copy of ``model``:

    * ``reshard(modes, trainable) -> Programs`` shards it with its submodules in ``modes`` (FQN -> training) and
      its parameters requiring grad as ``trainable`` says (FQN -> requires_grad). ``constants``: the tensor
      constants of the first trace (by name), which the programs are given.
    * ``train_override(fqn, mode, modes, requires_grad) -> (modes, requires_grad)`` runs ``train(mode)`` of the
      submodule at ``fqn`` (a class of the model's own that overrides ``nn.Module.train``, e.g. keeping its
      BatchNorms in eval) on the copy, its subtree first set to the stand-ins' current ``modes`` and
      ``requires_grad`` flags, and gives them after it (names relative to the submodule), for the stand-ins to
      take (``StandIn.train``); None when there is no copy."""
    # the tensors a traced constant may be, by FQN (a wrapper such as loss_parallel's makes its model's
    # buffers constants); a tensor the forward creates is numbered (lifted_tensor_N), not one of these
    plain = _tensor_attributes(model)
    attributes = set(plain) | {n for n, _ in itertools.chain(
        model.named_buffers(remove_duplicate=False), model.named_parameters(remove_duplicate=False))}
    try:
        skeleton: Optional[nn.Module] = _skeleton(model, plain)
        why = ""
    except Exception as e:  # noqa: BLE001 - reported when (if ever) the modes change
        skeleton, why = None, f"{type(e).__name__}: {e}"
    req = replace(req, example_inputs=pytree.tree_map(_meta_like, req.example_inputs),
                  kwargs=pytree.tree_map(_meta_like, req.kwargs))
    name = type(model).__name__

    def reshard(modes: dict[str, bool], trainable: dict[str, bool]) -> Programs:
        if skeleton is None:
            raise ShardingError(
                f"ShardedModule({name}): the train/eval modes or the parameters' requires_grad changed since "
                f"shard(), which needs the model traced "
                f"again, but fxshard could not keep a copy of it ({why}); shard the model in the modes you run it in"
            )
        for fqn, m in skeleton.named_modules():
            m.training = modes.get(fqn, m.training)
        for fqn, flag in trainable.items():
            skeleton.get_parameter(fqn).requires_grad_(flag)
        say = progress or (lambda msg: None)
        say(f"modes changed: sharding {name} again for {_mode_text(modes)}, "
            f"{sum(trainable.values())} of {len(trainable)} parameters trained")
        progs, again, _, _, _ = _shard_programs(skeleton, info, req, say)
        if again != placements:
            raise ShardingError(f"internal: sharding {name} for other modes placed its parameters differently; "
                                f"please report this model")
        for key, t in progs.traced.constants.items():
            if not (isinstance(t, torch.Tensor) and t.device.type == "meta"):
                continue
            if key in attributes and constants.get(key) is not None:  # the value shard() traced with
                progs.traced.constants[key] = constants[key]
                continue
            what = (f"a tensor attribute ({key}) that the modes it was sharded in did not use" if key in attributes
                    else f"a tensor its forward creates ({key}) on the input's device, which fxshard traces on meta")
            raise ShardingError(
                f"ShardedModule({name}): in {_mode_text(modes)} the model uses {what}, so fxshard has no value for "
                f"it after the mode change; register it as a buffer (self.register_buffer(...)), create it on the "
                f"CPU, or shard the model in these modes")
        return progs

    def train_override(fqn: str, mode: bool, modes: dict[str, bool], grads: dict[str, bool]
                       ) -> Optional[tuple[dict[str, bool], dict[str, bool]]]:
        if skeleton is None:
            return None
        sub = skeleton.get_submodule(fqn)
        for n, m in sub.named_modules():  # start from the stand-ins' state, as eager's override starts from its own
            m.training = modes.get(n, m.training)
        for n, p in sub.named_parameters():
            p.requires_grad_(grads.get(n, p.requires_grad))
        try:
            sub.train(mode)
        except Exception as e:  # noqa: BLE001 - the user's override, on meta tensors
            raise ShardingError(
                f"ShardedModule({name}): {type(sub).__name__}.train({mode}) (the model's own override of "
                f"nn.Module.train) failed on fxshard's copy of the model, whose tensors are on the meta device "
                f"({type(e).__name__}: {e}); an override may only set modes and requires_grad: set the modes on the "
                f"stand-ins instead (sm.<submodule>.eval())") from e
        return {n: m.training for n, m in sub.named_modules()}, {n: p.requires_grad for n, p in sub.named_parameters()}

    return reshard, train_override


def _mode_text(modes: dict[str, bool]) -> str:
    evals = [fqn or "<root>" for fqn, training in modes.items() if not training]
    if not evals:
        return "training mode"
    return "eval mode" if len(evals) == len(modes) else f"eval mode in {evals[:4]}{' ...' if len(evals) > 4 else ''}"


def _shard_training(traced: Traced, ctx: ShardContext, wants_grad: list[bool],
                    say: Callable[[str], None], pipeline: Pipeline,
                    bucket_mb: Optional[float] = DEFAULT_BUCKET_MB, remat: Policy = Policy()) -> Training:
    """Trace the joint graph from the still-global forward, shard it with the forward's seeds, split it."""
    say("tracing forward + backward (joint graph)")
    joint = trace_joint(traced, traced.gm, wants_grad)
    jctx = joint_context(traced, ctx, joint, bucket_mb)
    say(f"sharding the training program ({len(joint.gm.graph.nodes)} nodes)")
    gm = pipeline.run(joint.gm, jctx)
    split = partition(joint, gm, remat, ctx.mesh.sizes)
    with remembering_values():  # the forward's fake run (overlap pass) gives its backward the saved values
        fwd = pipeline.finish(split.fwd, jctx)
        saved = lambda: output_values(fwd, ctx.mesh)[joint.n_out:]  # noqa: E731
        bwd = pipeline.finish(split.bwd, replace(jctx, program_inputs=saved), "backward")
    fb = list(jctx.fallbacks)
    updated = [i for i, slot in enumerate(traced.slots) if slot.kind == "buffer" and set(slot.names) & set(traced.mutations)]
    return Training(Program(fwd, "forward", fb), Program(bwd, "backward", fb), joint.n_out,
                    joint.diff_out, joint.diff_in, updated, joint.grad_out, joint.reaches)


def _local_tensors(model: nn.Module, traced: Traced, placements: dict, mesh: DeviceMesh, device: torch.device,
                   src_data_rank: Optional[int]) -> tuple[dict[str, torch.Tensor], list[str], dict[str, tuple]]:
    """Local tensors of every parameter/buffer, the names of those that hold no values yet, and per name the
    model's tensor and its ``sources.Layout`` (what ``sources.remember`` takes).

    A tensor of the model that is the source of a live ShardedModule's local tensor gets that same local
    tensor (``sources.shared_local``: no copy, no broadcast, as it may have trained since); any other gets a
    new one (``_new_local``).
    """
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(dict(model.named_buffers(remove_duplicate=False)))
    out: dict[str, torch.Tensor] = {}
    unfilled: list[str] = []
    origins: dict[str, tuple] = {}
    info = MeshInfo.of(mesh)
    fake = dist.is_initialized() and dist.get_backend() == "fake"
    where = f"ShardedModule({type(model).__name__})"
    settle(named.values())
    for slot in traced.slots:
        if slot.kind not in ("param", "buffer"):
            continue
        name = slot.names[0]
        full = named[name]
        on = "meta" if fake and full.device.type == "meta" else device
        layout = Layout.of(mesh, placements[name], full.dtype, on)
        origins[name] = (full, layout)
        local = shared_local(full, layout, name, where)
        if local is not None:
            blank = is_blank(full, local)
        else:
            local, blank = _new_local(full, layout, mesh, info, src_data_rank)
            local = nn.Parameter(local, requires_grad=full.requires_grad) if slot.kind == "param" else local
        out[name] = local
        if blank:
            unfilled.append(name)
    return out, unfilled, origins


def _new_local(full: torch.Tensor, layout: Layout, mesh: DeviceMesh, info: MeshInfo, src_data_rank: Optional[int]
               ) -> tuple[torch.Tensor, bool]:
    """This rank's new local tensor of ``full`` laid out per ``layout``, and whether it holds no values yet.

    A real tensor is sliced where it lives and only the shard moves to the layout's device; with
    ``src_data_rank`` set (and a mesh that moves data) the full tensor of that rank is broadcast first. A meta
    tensor becomes a local shard filled with a sentinel (NaN, or the integer maximum) that ``ShardedModule``
    reports as unfilled until something writes it; on the fake process group, where nothing runs, shards of
    meta tensors stay on meta.
    """
    if full.device.type == "meta":
        shape = [int(s) for s in local_shape(tuple(full.shape), layout.placements, tuple(mesh.shape), info.coords)]
        local = torch.empty(shape, dtype=full.dtype, device=layout.device)
        if local.device.type == "meta":
            return local, False
        fill = sentinel(full.dtype)
        if fill is not None:
            local.fill_(fill)
        return local, local.numel() > 0
    src = src_data_rank if communicates(mesh) else None
    with torch.no_grad():
        source = from_source(full, src, mesh, layout.device) if src is not None else full.detach()
        # slice where the full tensor lives, then move only the shard (no full copy on this rank's device)
        return take(source, layout.placements, info).to(layout.device, copy=True), False
