"""``fxshard.jit``: shard a whole pure function over pytrees of tensors, JAX-style.

A training step written functionally (``torch.func.functional_call`` +
``torch.func.grad_and_value``, the optimizer update as tensor math, returning
the loss and the new parameters and optimizer state) is one ATen graph: the
forward, the backward and the update. ``jit`` traces it with global shapes
under fake tensors, seeds its inputs from ``in_specs``, requires its outputs
per ``out_specs``, and runs the same passes as ``fxshard.shard`` (propagate,
redistribute, localize, emit). The backward and optimizer collectives fall
out of propagation; parameters and optimizer state stay sharded end to end.

Tracing (``ShardedFunction._trace``) requires a pure ``fn`` and ensures a
functional core-ATen graph with one placeholder per tensor leaf of the
arguments (in pytree order, named after the argument path, e.g.
``in_params_net1_weight``) and one output per leaf of the result:
``make_fx(fn, tracing_mode="fake")`` with the table the training graph of
``fxshard.shard`` is traced with (``fxshard.tracing.decompositions.joint_decomposition_table()``:
fused kernels that have rules kept, ``scatter.value`` rewritten into ops that have rules), attention as one
``fxshard::attention`` node (``fxshard/ops/attention.py::attention_as_one_op``, its backward one
``fxshard::attention_backward``); a graph with in-place ops is traced again under ``functionalize``
(``functionalize`` is not the outer transform of the first trace because it
rejects the autograd.Function ``fxshard.constrain`` differentiates through
under ``torch.func``); ``aten.alias`` and shape assertions dropped and the graph
CSE'd, as ``tracing/joint.py`` does. A mutated argument is a ShardingError.
``fxshard.constrain`` calls in ``fn`` are recorded and pin placements as they
do under ``fxshard.shard``.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.distributed.device_mesh import DeviceMesh
from torch.func import functionalize
from ..core.torch_compat import pytree

from ..ops.attention import attention_as_one_op
from ..tracing.captured import Captured, captured_scalars, check_captured, settled_after_trace
from ..comm.failures import run_program
from ..comm.consistency import check_generators_agree, stable_repr
from ..plans.constrain import constraint_scope
from ..planner.cost import linked_mesh_info
from ..core.context import ShardContext, runtime_device
from ..runtime.description import Sharding
from ..core.errors import ShardingError
from ..tracing.forward_state import host_rngs_unchanged
from ..runtime.inputs import check_replicated_values
from ..core.mesh import MeshInfo
from ..runtime.programs import Program
from .common import check_consistent, context_for, graph_outputs, required_outputs
from ..tracing.annotate import check_divisible, spec_leaves
from ..planner.solve import PLANNERS
from ..tracing.cse import cse
from ..tracing.decompositions import joint_decomposition_table
from ..tracing.export import DROP
from ..tracing.failures import tracing_errors
from ..tracing.margin_losses import margin_losses_as_eager
from ..passes.pipeline import DEFAULT, Pipeline
from ..core.placements import P, Pl
from ..plans.plan import is_spec_leaf, to_placements
from ..core.spec import fmt_placements, shard_factor
from ..core.torch_compat import FakeTensorMode, OpOverload, ShapeEnv, make_fx

__all__ = ["jit", "ShardedFunction"]

aten = torch.ops.aten

_JIT_EVEN = ("fxshard.jit infers global shapes from local ones, so its inputs and outputs must split evenly "
             "(uneven splits work with fxshard.shard)")


@dataclass
class _Leaf:
    """One flattened argument leaf: a tensor (with its placements) or a static Python value."""

    path: str  # readable, e.g. "params['net1.weight']"
    is_tensor: bool
    value: Any = None  # static leaves only
    pls: tuple[Pl, ...] = ()
    global_shape: tuple[int, ...] = ()
    local_shape: tuple[int, ...] = ()
    dtype: Optional[torch.dtype] = None


@dataclass
class _Compiled:
    """One traced and sharded program, for one input signature."""

    program: Program
    out_tree: Any
    tree: Any = None  # the input signature it was traced for
    leaves: Sequence[_Leaf] = ()
    captured: Sequence[Captured] = ()  # the Python scalars fn read by name, as they were when traced


def _functionalized(gm: fx.GraphModule, fakes: list[torch.Tensor]) -> fx.GraphModule:
    """``gm`` re-traced under ``functionalize``: in-place ops become functional, and an updated
    argument becomes a final ``copy_`` into its placeholder; nodes keep their source lines."""
    def run(*args: torch.Tensor) -> Any:
        with fx_traceback.preserve_node_meta():
            return fx.Interpreter(gm).run(*args)

    return make_fx(functionalize(run, remove="mutations"), tracing_mode="fake",
                   decomposition_table=joint_decomposition_table())(*fakes)


def _path_str(names: Sequence[str], path: tuple) -> str:
    head, rest = path[0], path[1:]
    i = getattr(head, "idx", None)
    base = names[i] if isinstance(i, int) and i < len(names) else f"args[{i}]"
    return base + pytree.keystr(rest)


def _ident(s: str) -> str:
    s = re.sub(r"[^0-9a-zA-Z_]+", "_", s).strip("_")
    return s if s and not s[0].isdigit() else f"a_{s}"


def _static_key(x: Any) -> Any:
    try:
        hash(x)
        return (type(x), x)
    except TypeError:
        return (type(x), repr(x))



def check_no_autocast(where: str, device_type: str) -> None:
    """Requires: ``device_type`` is the mesh's (``"cpu"``, ``"cuda"``, ...). Ensures: returns if
    ``torch.autocast`` is off for it, else raises ShardingError. ``fxshard.jit`` traces its programs without
    autocast and runs them as traced: under it, a call would compute in other dtypes than eager does."""
    if not torch.is_autocast_enabled(device_type):
        return
    raise ShardingError(
        f"{where}: torch.autocast is enabled for {device_type!r} (dtype {torch.get_autocast_dtype(device_type)}), "
        f"but fxshard.jit traces and runs its programs without autocast, so its casts would not be eager's. Run "
        f"this outside the autocast context (or inside torch.autocast({device_type!r}, enabled=False)); for "
        f"mixed precision, shard a module with fxshard.shard() called inside torch.autocast (its programs hold "
        f"autocast's casts), or convert the model and inputs (e.g. model.to(torch.bfloat16))")

class ShardedFunction:
    """This rank's sharded version of a pure function (returned by :func:`jit`).

    ``__call__(*args)`` takes this rank's LOCAL pieces of the arguments (laid
    out per ``in_specs``) and returns the local pieces of the results (per
    ``out_specs``), in the same pytree structures as the function's. The
    program is traced for one input signature (pytree structure, local
    shapes, dtypes, static leaf values) and cached; a new signature traces
    again (on every rank, like ``jax.jit``). ``fxshard.explain`` and
    ``fxshard.comm_stats`` describe the most recently used program.
    """

    def __init__(self, fn: Callable, mesh: DeviceMesh, in_specs: Any, out_specs: Any,
                 pipeline: Pipeline = DEFAULT, planner: str = "global") -> None:
        self._fn = fn
        self._pipeline = pipeline
        self._planner = planner
        self._mesh = mesh
        self._info = linked_mesh_info(mesh)
        self._in_specs = in_specs
        self._out_specs = out_specs
        self._cache: dict[Any, _Compiled] = {}
        self._values_checked: set = set()  # signatures whose first call compared replicated arguments
        self._last: Optional[_Compiled] = None
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            sig = None
        self._sig = sig
        self._arg_names: list[str] = []
        if sig is not None:
            self._arg_names = [p.name for p in sig.parameters.values()
                               if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

    # ---- describing -------------------------------------------------------------------------
    def _programs(self) -> list[Program]:
        if self._last is None:
            raise ShardingError(
                f"fxshard.jit({self.__name__}) has not been traced yet, so there is no program to describe; "
                f"call it once, or pass example_inputs= (global shapes, meta tensors work) to fxshard.jit"
            )
        return [self._last.program]

    @property
    def sharding(self) -> Sharding:
        """A read-only view of the most recently used program (``fxshard.runtime.description.Sharding``);
        a ShardingError before the first trace."""
        prog = self._programs()[0]
        return Sharding(self._info, (prog,), prog)

    @property
    def graph_module(self) -> fx.GraphModule:
        """The per-rank GraphModule of the most recently used program."""
        return self._programs()[0].gm

    def __repr__(self) -> str:
        return (f"ShardedFunction({self.__name__}, mesh={dict(zip(self._info.names, self._info.sizes))}, "
                f"traced signatures={len(self._cache)})")

    # ---- arguments ---------------------------------------------------------------------------
    def _check_arity(self, args: tuple) -> None:
        if self._sig is not None:
            try:
                self._sig.bind(*args)
            except TypeError as e:
                raise ShardingError(
                    f"{self.__name__}{self._sig} was called with {len(args)} positional argument(s): {e}; "
                    f"call the sharded function with the same positional arguments as the original "
                    f"(keyword arguments are not supported: pass them positionally)"
                ) from None
        specs = self._in_specs
        if specs is not None and isinstance(specs, (tuple, list)) and not is_spec_leaf(specs):
            if len(specs) != len(args):
                raise ShardingError(
                    f"in_specs has {len(specs)} entries but {self.__name__} was called with {len(args)} positional "
                    f"argument(s); give in_specs one entry (a spec or a spec pytree, None for replicated) per "
                    f"positional argument"
                )

    def _leaves(self, args: tuple, global_shapes: bool) -> tuple[list[_Leaf], list[Any], Any]:
        """Describe the flattened ``args``; ``global_shapes`` says whether tensors hold global or local shapes."""
        self._check_arity(args)
        with_path, tree = pytree.tree_flatten_with_path(tuple(args))
        flat = [x for _, x in with_path]
        specs = spec_leaves(self._in_specs, tuple(args), "in_specs") if self._in_specs is not None \
            else [None] * len(flat)
        info = self._info
        leaves: list[_Leaf] = []
        for (path, x), spec in zip(with_path, specs):
            name = _path_str(self._arg_names, path)
            if not isinstance(x, torch.Tensor):  # static: the same Python value on every rank; specs do not apply
                leaves.append(_Leaf(name, False, value=x))
                continue
            pls = to_placements(spec, info, x.dim(), f"in_specs for {name}")
            shape = tuple(int(s) for s in x.shape)
            if global_shapes:
                check_divisible(f"{name} (shape {shape})", shape, pls, info, uneven=False, even_why=_JIT_EVEN)
                gshape = shape
                lshape = tuple(s // shard_factor(pls, info.sizes, d) for d, s in enumerate(shape))
            else:
                lshape = shape
                gshape = tuple(s * shard_factor(pls, info.sizes, d) for d, s in enumerate(shape))
            leaves.append(_Leaf(name, True, pls=pls, global_shape=gshape, local_shape=lshape, dtype=x.dtype))
        return leaves, flat, tree

    @staticmethod
    def _key(tree: Any, leaves: list[_Leaf]) -> Any:
        return (tree, tuple(("T", l.local_shape, l.dtype) if l.is_tensor else ("S", _static_key(l.value))
                            for l in leaves))

    # ---- tracing -----------------------------------------------------------------------------
    def _compile(self, leaves: list[_Leaf], tree: Any) -> _Compiled:
        info = self._info
        check_consistent(info, self._in_specs, self._out_specs, {
            "function": getattr(self._fn, "__qualname__", self.__name__),
            "planner": self._planner,
            "input signature": stable_repr([(l.path, l.global_shape, str(l.dtype)) if l.is_tensor else (l.path, l.value)
                                            for l in leaves]),
        })
        captured = captured_scalars(self._fn)
        with constraint_scope(functional=True) as recorded:
            gm, out_tree = self._trace(leaves, tree, runtime_device(ShardContext(mesh=info)))
        captured = settled_after_trace(captured, f"fxshard.jit({self.__name__}): while traced, {self.__name__}")
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        seeds = {}
        for node, leaf in zip(placeholders, [l for l in leaves if l.is_tensor]):
            node._rename("in_" + _ident(leaf.path))
            node.target = node.name  # the argument name in the generated code, too
            seeds[node] = leaf.pls
        out_required = required_outputs(graph_outputs(gm), out_tree, self._out_specs, info, even_why=_JIT_EVEN)
        # fxshard.constrain calls in fn mean what they mean in shard()
        ctx = context_for(gm, info, seeds, out_required, recorded, planner=self._planner)
        gm = self._pipeline(gm, ctx)
        check_generators_agree(info, f"{self.__name__}'s sharded program", [gm])
        return _Compiled(Program(gm, "forward", list(ctx.fallbacks)), out_tree, tree, leaves, captured)

    def _trace(self, leaves: list[_Leaf], tree: Any, device: torch.device) -> tuple[fx.GraphModule, Any]:
        fn = self._fn
        out_tree: list[Any] = [None]

        def flat_fn(*tensors: torch.Tensor) -> list[Any]:
            it = iter(tensors)
            flat = [next(it) if l.is_tensor else l.value for l in leaves]
            with margin_losses_as_eager(), attention_as_one_op():
                outs = fn(*pytree.tree_unflatten(flat, tree))
            out_flat, out_tree[0] = pytree.tree_flatten(outs)
            for i, o in enumerate(out_flat):
                if not isinstance(o, (torch.Tensor, int, float, bool, str)):
                    raise ShardingError(
                        f"{self.__name__} returned a {type(o).__name__} as output leaf {i}; a jitted function "
                        f"returns pytrees (tuples, lists, dicts) of tensors and Python scalars only"
                    )
            return out_flat

        anchor = getattr(torch.fx.proxy, "_register_stack_trace_anchor", None)
        if anchor is not None:  # keep fn's own frames in stack traces: explain() names the line of the step
            anchor(fn)
        mode = FakeTensorMode(allow_fallback_kernels=True, shape_env=ShapeEnv(), static_shapes=True)
        with mode:  # fake tensors with the global shapes: nothing is allocated
            fakes = [torch.empty(l.global_shape, dtype=l.dtype, device=device) for l in leaves if l.is_tensor]
        with tracing_errors(f"{self.__name__} with make_fx (fake tensors, global shapes)",
                            "a jitted function must be pure tensor code: no data-dependent Python control flow, no "
                            ".item()/.tolist(), every tensor it reads passed as an argument"):
            # plain make_fx first (functionalize rejects the autograd.Function fxshard.constrain uses under
            # torch.func); only a graph with in-place ops is re-traced under functionalize, where a mutated
            # argument shows up as a final copy_ into its placeholder (rejected below).
            with host_rngs_unchanged(f"the jitted function {self.__name__}"):
                gm = make_fx(flat_fn, tracing_mode="fake", decomposition_table=joint_decomposition_table(),
                             record_stack_traces=True)(*fakes)
            if any(isinstance(n.target, OpOverload) and n.target._schema.is_mutable
                   for n in gm.graph.nodes):
                gm = _functionalized(gm, fakes)
        g = gm.graph
        paths = {n: l.path for n, l in zip([n for n in g.nodes if n.op == "placeholder"],
                                            [l for l in leaves if l.is_tensor])}
        for n in list(g.nodes):
            if n.op != "call_function":
                continue
            if n.target is aten.alias.default:
                n.replace_all_uses_with(n.args[0])
                g.erase_node(n)
            elif n.target in DROP:
                g.erase_node(n)
            elif isinstance(n.target, OpOverload) and n.target._schema.is_mutable:
                dst = n.args[0] if n.args else None
                what = f"its argument {paths[dst]}" if dst in paths else f"a tensor ({n.target})"
                raise ShardingError(
                    f"{self.__name__} updates {what} in place; fxshard.jit shards pure functions: compute the new "
                    f"value and return it (p = p - lr * g instead of p.sub_(lr * g); torch.optim optimizers "
                    f"update in place, so write the update as tensor math and return the new state)"
                )
        g.eliminate_dead_code()
        gm = cse(gm)
        return gm, out_tree[0]

    # ---- running -----------------------------------------------------------------------------
    def lower(self, *global_args: Any) -> "ShardedFunction":
        """Trace and shard ahead of time for arguments with GLOBAL shapes (real or meta tensors); returns self."""
        check_no_autocast(f"{self.__name__}.lower()", self._mesh.device_type)
        leaves, _, tree = self._leaves(tuple(global_args), global_shapes=True)
        key = self._key(tree, leaves)
        if key not in self._cache:
            self._cache[key] = self._compile(leaves, tree)
        self._last = self._cache[key]
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Local results for this rank's local arguments (see class doc)."""
        if kwargs:
            raise ShardingError(
                f"{self.__name__} was called with keyword arguments {sorted(kwargs)}; a jitted function takes "
                f"positional arguments only (in_specs describes them by position): pass them positionally"
            )
        check_no_autocast(f"{self.__name__} was called", self._mesh.device_type)
        leaves, flat, tree = self._leaves(tuple(args), global_shapes=False)
        for x, leaf in zip(flat, leaves):
            if leaf.is_tensor and x.device.type == "meta":
                raise ShardingError(
                    f"{self.__name__}: argument {leaf.path} is a meta tensor: it has a shape but no data, so the "
                    f"program cannot run on it; pass real local pieces (to trace ahead of time from meta "
                    f"tensors, give them with GLOBAL shapes to fxshard.jit(example_inputs=...) or sf.lower())"
                )
        key = self._key(tree, leaves)
        comp = self._cache.get(key)
        if comp is None:
            self._check_not_global(leaves, tree)
            comp = self._cache[key] = self._compile(leaves, tree)
        self._last = comp
        check_captured(comp.captured, f"fxshard.jit({self.__name__}): {self.__name__}")
        tensors = [x for x, l in zip(flat, leaves) if l.is_tensor]
        if key not in self._values_checked:
            check_replicated_values(tensors, [l.pls for l in leaves if l.is_tensor],
                                    [f"{self.__name__}: argument {l.path}" for l in leaves if l.is_tensor], self._mesh)
            self._values_checked.add(key)
        with torch.no_grad():  # a pure program on local tensors: differentiate inside fn, not through it
            outs = run_program(comp.program.gm, tensors, f"fxshard.jit({self.__name__})")
        return pytree.tree_unflatten(list(outs), comp.out_tree)

    def _check_not_global(self, leaves: list[_Leaf], tree: Any) -> None:
        """Raise if a call that matches no traced signature is a traced one with some arguments given at
        their GLOBAL shape (a jitted function takes local pieces; tracing it again would shard a
        problem ``n`` times larger along each split dim)."""
        for comp in self._cache.values():
            if comp.tree != tree or len(comp.leaves) != len(leaves):
                continue
            wrong: list[tuple[_Leaf, _Leaf]] = []
            for new, old in zip(leaves, comp.leaves):
                if new.is_tensor != old.is_tensor or (not new.is_tensor and _static_key(new.value) != _static_key(
                        old.value)) or (new.is_tensor and new.dtype != old.dtype):
                    break
                if new.is_tensor and new.local_shape != old.local_shape:
                    if new.local_shape != old.global_shape:
                        break
                    wrong.append((new, old))
            else:
                if wrong:
                    new, old = wrong[0]
                    others = f" (and {len(wrong) - 1} more argument(s) likewise)" if len(wrong) > 1 else ""
                    raise ShardingError(
                        f"fxshard.jit({self.__name__}): argument {new.path} has shape {list(new.local_shape)}, "
                        f"the GLOBAL shape it was traced for (laid out {fmt_placements(old.pls)} over the mesh "
                        f"{dict(zip(self._info.names, self._info.sizes))}){others}; a jitted function takes each "
                        f"rank's LOCAL piece, here of shape {list(old.local_shape)} (e.g. x.chunk(n, dim)[rank]). "
                        f"To run a genuinely new local size, trace it first: sf.lower(*global_args)"
                    )


def _check_spec_tree(specs: Any, what: str, info: MeshInfo) -> None:
    """Every leaf of a spec pytree is None or a spec, and every mesh axis a P names exists (before tracing)."""
    if specs is None:
        return
    if is_spec_leaf(specs):
        if isinstance(specs, P):
            for d in range(len(specs)):
                for a in specs.axes_of(d):
                    if a not in info.names:
                        raise ShardingError(
                            f"{what}: {specs!r} names mesh axis {a!r}, but the mesh axes are {info.names}; "
                            f"use one of those names"
                        )
        return
    if isinstance(specs, (tuple, list)):
        for i, s in enumerate(specs):
            _check_spec_tree(s, f"{what}[{i}]", info)
        return
    if isinstance(specs, dict):
        for k, s in specs.items():
            _check_spec_tree(s, f"{what}[{k!r}]", info)
        return
    raise ShardingError(
        f"{what}: {specs!r} is not a sharding spec; use None (replicated), P('tp', None), Shard(0)/Replicate() "
        f"(one per mesh axis), or a tuple/list/dict of those shaped like the values"
    )


def jit(fn: Callable, mesh: DeviceMesh, *, in_specs: Any = None, out_specs: Any = None,
        example_inputs: Optional[Sequence[Any]] = None, pipeline: Pipeline = DEFAULT,
        planner: str = "global") -> ShardedFunction:
    """Shard the pure function ``fn`` over ``mesh``; returns this rank's :class:`ShardedFunction`.

    ``fn(*args)`` takes and returns pytrees (tuples, lists, dicts) of tensors;
    Python scalars among the arguments are static (baked into the program).
    ``in_specs`` is a spec pytree prefix of ``args`` and ``out_specs`` one of
    the results: each spec is ``None`` (replicated), a ``P(...)`` or
    placements (``Shard``/``Replicate``/``Partial``, one per mesh axis), and
    one spec at an inner node covers every tensor under it (so
    ``in_specs=(param_specs, param_specs, None)`` shards parameters and the
    optimizer state alike and replicates the batch). Default: replicated.

    The result is called on each rank with the LOCAL pieces of the arguments
    and returns the local pieces of the results laid out per ``out_specs``;
    nothing is gathered that ``out_specs`` does not ask for. The program is
    traced at the first call (global shapes follow from the local ones and
    the specs) or ahead of time from ``example_inputs`` with GLOBAL shapes
    (real or meta tensors: tracing uses fake tensors and allocates nothing).
    A call that matches a traced signature except that some arguments have
    the GLOBAL shape it was traced for raises a ShardingError (global pieces
    passed by mistake); other new signatures trace again. ``fxshard.constrain``
    calls inside ``fn`` pin placements as they do under ``fxshard.shard``, and
    a collective that times out (a rank skipped a call) raises a ShardingError
    naming it.

    A training step fits when written functionally, e.g.::

        def step(params, opt_state, batch):
            grads, loss = torch.func.grad_and_value(
                lambda p: loss_fn(torch.func.functional_call(model, p, batch)))(params)
            new = {k: params[k] - lr * grads[k] for k in params}
            return loss, new, opt_state

    Limits: ``fn`` must be pure. In-place updates (``p.sub_(...)``, and so
    ``torch.optim`` optimizers, which update in place) are rejected with a
    ShardingError: write the optimizer as tensor math (for AdamW: ``m``,
    ``v`` and a step-count tensor as state). Pass every tensor ``fn`` reads as
    an argument (a model's buffers too, via ``functional_call``); pass a
    step count or a scheduled learning rate as a tensor, not a Python number,
    or each new value traces again. Differentiate inside ``fn``: the returned
    function runs under ``no_grad``. Uneven shards are not supported (split
    dims must divide). Spec errors and calls with the wrong number of
    arguments raise ShardingError. ``pipeline`` is the pass pipeline and ``planner`` the planner
    (``"global"``, default, or ``"greedy"``), as for ``fxshard.shard``.
    """
    if not callable(fn):
        raise ShardingError(f"fxshard.jit expects a function, got {type(fn).__name__}; pass the step function itself")
    if planner not in PLANNERS:
        raise ShardingError(f"fxshard.jit: planner={planner!r} is not a planner; use one of {PLANNERS} "
                            f"(default 'global')")
    sf = ShardedFunction(fn, mesh, in_specs, out_specs, pipeline, planner)
    if isinstance(in_specs, (tuple, list)) and not is_spec_leaf(in_specs):
        for i, s in enumerate(in_specs):
            name = sf._arg_names[i] if i < len(sf._arg_names) else f"args[{i}]"
            _check_spec_tree(s, f"in_specs for {name}", sf._info)
    else:
        _check_spec_tree(in_specs, "in_specs", sf._info)
    _check_spec_tree(out_specs, "out_specs for output", sf._info)
    if example_inputs is not None:
        ex = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        sf.lower(*ex)
    return sf
