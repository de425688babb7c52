"""Pass 1, trace: model + example inputs -> core-ATen fx graph with global shapes.

Requires: an nn.Module whose forward is traceable by ``torch.export``
(non-strict) with the example inputs; parameters may live on the meta device.
Ensures: a GraphModule whose placeholders are, in order, one per unique
parameter/buffer tensor (tied parameters are one placeholder), lifted
constants, then the flattened tensor leaves of ``(args, kwargs)``; every node
carries ``meta["val"]`` (a fake tensor with global, possibly symbolic, shape).
``_softmax``/``_log_softmax`` are decomposed so a split softmax dim becomes
Partial reductions, while the fused kernels in ``FUSED_FORWARD`` stay fused and the ops in
``EAGER_DERIVATIVE`` whole (the joint trace's autograd then applies eager's derivative to them;
``decompositions.py``);
shape assertions and no-op clones are dropped (the former refer to global sizes). Ops torch decomposes
above autograd into a wrong program (the margin losses, ``margin_losses.py``) are replaced first, and
attention becomes one device-neutral ``fxshard::attention`` node (``fxshard/ops/attention.py::route_exported``;
with dropout, or under ``sdpa_kernel(SDPBackend.MATH)``, torch's math form, decomposed).
Export's graph is decomposed by re-tracing it with ``make_fx`` over functional
fake tensors (``_decomposed``: what ``run_decompositions`` gives, at half its
cost); buffers the forward updates in place are its first outputs.
Stop-gradients survive the decompositions: every value the model ``.detach()``-ed
or computed under ``torch.no_grad()`` reaches its consumers through an
``aten.alias`` node flagged ``meta[STOP_KEY]`` (``trace_joint`` detaches there); a tensor a
``no_grad`` region hands back as itself (a no-op ``.to``) keeps its gradient, as in eager
(``stop_gradients.py``). Identical pure nodes are merged (``cse.py``).
Under ``torch.autocast`` (``trace_forward(autocast=...)``, ``fxshard/core/precision.py``) the forward runs inside it
and its casts are ``_to_copy`` nodes; casts to another dtype are never merged (two uses' gradients then sum
in the wider dtype, as eager's do).
No real weight is allocated.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import traceback
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.export.graph_signature import ConstantArgument, InputKind
from torch.overrides import TorchFunctionMode
from ..core.torch_compat import pytree

from ..ops.attention import route_exported
from ..plans.constrain import constraint_scope, record
from .cumulative_bn import cumulative_batch_norm_traceable
from .eager_branches import eager_branches
from .custom_grads import custom_gradients_checked
from ..core.errors import ShardingError
from .forward_state import forward_state_unchanged, warn_traced_hooks
from .fake import fake_inputs, functional_make_fx, named_placeholders, reject_effect_tokens
from ..core.precision import AUTOCAST_DEVICES, AutocastState, autocast_off
from .by_op import by_op_enabled, forward_by_op
from .cse import cse
from .decompositions import decomposition_table
from .failures import quiet_unless_ok, tracing_errors
from .margin_losses import replace_above_autograd
from .simplify import drop_noop_clones
from .stop_gradients import STOP_GRADIENT, flag_stop_gradients, mark_stop_gradients
from ..core.torch_compat import from_fun, has_data_mutation, has_metadata_mutation, to_fun
from ..core.torch_compat import FakeTensorMode, ShapeEnv

aten = torch.ops.aten

__all__ = ["Traced", "Slot", "trace_forward", "DROP"]


@dataclass
class Slot:
    """One placeholder of the traced graph: what feeds it at run time."""

    kind: str  # "param" | "buffer" | "constant" | "input"
    names: list[str]  # FQNs for params/buffers (all aliases of a tied tensor), [] for inputs
    index: int = -1  # position among the flattened user-input tensor leaves
    persistent: bool = True
    requires_grad: bool = False


@dataclass
class Traced:
    """The traced global program and how to feed it."""

    gm: fx.GraphModule
    slots: list[Slot]
    in_tree: Any  # pytree spec of (args, kwargs)
    out_tree: Any
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    n_user_leaves: int = 0
    tensor_leaf_positions: list[int] = field(default_factory=list)
    mutations: list[str] = field(default_factory=list)  # buffers updated in place: the first outputs
    # non-tensor user inputs (floats, ints, bools, strings, None): export specializes the program to
    # their example values, so a call must pass the same values (flat leaf position -> example value)
    constant_leaves: dict[int, Any] = field(default_factory=dict)


DROP = {
    aten._assert_tensor_metadata.default,
    aten._assert_scalar.default,
    aten.sym_constrain_range_for_size.default,
    aten._assert_async.msg,
}


def _decomposed(gm: fx.GraphModule, table: dict) -> tuple[fx.GraphModule, list[int]]:
    """``gm`` (an exported program's graph) re-traced by ``make_fx`` with ``table`` over functional fake
    tensors, and the positions of the placeholders it updates in place: the graph
    ``ExportedProgram.run_decompositions(table)`` gives (same placeholders and names, core ATen, nodes
    keep their source lines; each updated placeholder's new value an output, in placeholder order,
    before ``gm``'s outputs), at about half its cost (it traces the program twice and collects every
    CompositeImplicitAutograd op per call). Where it can, one distinct op at a time
    (``fxshard/tracing/by_op.py``; the same graph)."""
    with _recurrent_per_step(gm):
        return _decomposed_here(gm, table)


_RECURRENT = (aten.lstm.input, aten.lstm.data)


def _recurrent_per_step(gm: fx.GraphModule) -> Any:
    """oneDNN off while ``gm``'s LSTMs are decomposed: torch's decomposition picks ``mkldnn_rnn_layer`` for an
    LSTM on CPU whose input needs no gradient, as in the forward trace; that kernel has no sharding rule,
    and its backward needs a workspace the traced forward does not keep (an LSTM's backward failed with a
    bare RuntimeError). Without it the decomposition is per time step, every op has a rule, and the
    backward is derived like any other's."""
    if any(n.op == "call_function" and n.target in _RECURRENT for m in gm.modules() if isinstance(m, fx.GraphModule)
           for n in m.graph.nodes):
        return torch.backends.mkldnn.flags(enabled=False)
    return contextlib.nullcontext()


def _decomposed_here(gm: fx.GraphModule, table: dict) -> tuple[fx.GraphModule, list[int]]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    vals = [n.meta.get("val") for n in placeholders]
    inputs, _, tracing_mode = fake_inputs(vals)
    if tracing_mode == "fake" and by_op_enabled():
        fast = forward_by_op(gm, table)  # the same graph, each distinct op traced once
        if fast is not None:
            return fast, []
    interp = fx.Interpreter(gm)
    mutated: list[int] = []

    def forward(*args: Any) -> tuple:
        # as run_decompositions traces: inputs that require grad do here too, under no_grad; composites
        # pick their kernels by both (embedding_bag's forward-only kernel has no backward; attention keeps
        # its fused kernel, which the joint trace decomposes where its backward falls short)
        funs = [to_fun(a).requires_grad_() if isinstance(a, torch.Tensor) and v.requires_grad else to_fun(a)
                for a, v in zip(args, vals)]
        with fx_traceback.preserve_node_meta():
            outs = interp.run(*funs)
        for i, f in enumerate(funs):
            if isinstance(f, torch.Tensor) and has_metadata_mutation(f, args[i], check_only_storage_mutation=False):
                raise ShardingError(f"forward changes the shape or strides of its input {placeholders[i].name!r} "
                                    f"in place; compute a new tensor and return it instead")
        mutated[:] = [i for i, f in enumerate(funs) if isinstance(f, torch.Tensor) and has_data_mutation(f)]
        return tuple([from_fun(funs[i]) for i in mutated] + [from_fun(o) if isinstance(o, torch.Tensor) else o
                                                             for o in outs])

    with torch.no_grad():
        out = functional_make_fx(forward, inputs, tracing_mode, table)
    reject_effect_tokens(out, "the forward", "the error check (the _ex variant: torch.linalg.inv_ex for inv)")
    return named_placeholders(out, [n.name for n in placeholders]), mutated


def _distinct(args: Any, kwargs: Any) -> tuple[Any, Any]:
    """Example inputs where no tensor object appears twice: export traces one tensor passed twice as one
    input (the program then reads the last of those arguments in place of both), while the sharded
    module takes them as separate arguments."""
    seen: set[int] = set()

    def once(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) in seen:
            return x.detach().clone().requires_grad_(x.requires_grad)
        seen.add(id(x))
        return x

    return pytree.tree_map(once, args), pytree.tree_map(once, kwargs)


def _on_device(args: Any, kwargs: Any, device: torch.device) -> tuple[Any, Any]:
    """Example inputs on ``device``: real tensors are moved (meta ones to a meta model), meta tensors for a
    real model become fake tensors on the model's device (export traces them; nothing is allocated)."""
    leaves = pytree.tree_leaves((args, kwargs))
    if device.type != "meta" and any(isinstance(x, torch.Tensor) and x.device.type == "meta" for x in leaves):

        mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())

        def fake(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            with mode:
                t = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)
            return t.requires_grad_(x.requires_grad) if x.is_floating_point() else t

        return pytree.tree_map(fake, args), pytree.tree_map(fake, kwargs)
    if device.type == "meta":
        move = lambda x: x.to(device) if isinstance(x, torch.Tensor) and x.device != device else x  # noqa: E731
        return pytree.tree_map(move, args), pytree.tree_map(move, kwargs)
    return args, kwargs


@contextlib.contextmanager
def _boundary_hooks(model: torch.nn.Module, boundaries: Optional[dict]) -> Iterator[None]:
    """Record the plan's module-boundary constraints as ``fxshard::constrain`` ops while tracing."""
    handles = []
    modules = dict(model.named_modules(remove_duplicate=False))
    for fqn, bounds in (boundaries or {}).items():
        def pre(mod, args, kwargs, bounds=bounds):
            args = list(args)
            for b in bounds:
                for i, spec in enumerate(b.inputs[: len(args)]):
                    args[i] = record(args[i], spec)
                for k, spec in b.kwargs.items():
                    if k in kwargs:
                        kwargs[k] = record(kwargs[k], spec)
            return tuple(args), kwargs

        def post(mod, args, kwargs, out, bounds=bounds):
            for b in bounds:
                if isinstance(out, (tuple, list)):
                    out = type(out)(record(o, s) for o, s in zip(out, list(b.outputs) + [None] * len(out)))
                elif b.outputs:
                    out = record(out, b.outputs[0])
            return out

        m = modules[fqn]
        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True))
    try:
        with constraint_scope():
            yield
    finally:
        for h in handles:
            h.remove()


def _mutation_error(model: torch.nn.Module, spec: Any) -> ShardingError:
    """Why the forward may not update the input or parameter of ``spec`` in place, and what to do instead."""
    name = spec.target or spec.arg.name
    head = f"forward mutates {name!r} ({spec.kind.name}_MUTATION)"
    if spec.kind != InputKind.PARAMETER:
        return ShardingError(f"{head}; in-place updates of inputs are not supported: compute the new value and "
                             f"return it instead")
    fqn = name.rpartition(".")[0]
    owner = model.get_submodule(fqn)
    why = ""
    if isinstance(owner, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and owner.max_norm is not None:
        why = (f" ({type(owner).__name__} {fqn!r} has max_norm={owner.max_norm}: its forward renormalizes the rows it "
               f"looks up in place; set max_norm=None, or scale the rows in the forward out-of-place)")
    return ShardingError(
        f"{head}{why}; a sharded program does not update parameters while it runs (each rank holds pieces, and "
        f"the optimizer updates them): change the parameter outside the forward, e.g. under torch.no_grad() after "
        f"optimizer.step(), or compute the changed value as a new tensor in the forward")


_UNKNOWN_OUTPUT = re.compile(r"Found <class '([\w.]+)'> in output, which is not a known type")


def _unknown_output_error(model: torch.nn.Module, kwargs: dict, e: BaseException) -> Optional[ShardingError]:
    """The ShardingError for a forward that returns an object torch.export cannot flatten (``e`` is export's
    error), or None when ``e`` is another error. A Hugging Face model returning its key/value cache
    (``DynamicCache``, because ``config.use_cache`` is on) is told to pass ``use_cache=False``."""
    m = _UNKNOWN_OUTPUT.search(str(e))
    if m is None:
        return None
    cls = m.group(1)
    short = cls.rpartition(".")[2]
    config = getattr(model, "config", None)
    if "cache" in short.lower() and getattr(config, "use_cache", None) and kwargs.get("use_cache") is not False:
        return ShardingError(
            f"{type(model).__name__}'s forward returns a {short} (its key/value cache for generation, returned "
            f"because config.use_cache is True), which cannot be an output of a sharded program; for training "
            f"and one-pass inference pass use_cache=False in example_kwargs and in every call, or set "
            f"model.config.use_cache = False before fxshard.shard()")
    return ShardingError(
        f"{type(model).__name__}'s forward returns a {cls} object, which torch.export cannot take apart into "
        f"tensors; return tensors (or tuples, lists, dicts or dataclasses of them), or register {short} as a "
        f"pytree node (torch.utils._pytree.register_pytree_node) so its tensors can be outputs")


def _export_decomposed(model: torch.nn.Module, args: Any, kwargs: Any, dynamic_shapes: Any,
                       boundaries: Optional[dict], autocast: Optional[AutocastState]
                       ) -> tuple[Any, fx.GraphModule, list[int]]:
    """Export's program of ``model(*args, **kwargs)`` (inside ``autocast`` when given) and its decomposed
    graph with the placeholders it updates (``_decomposed``)."""
    off = autocast_off(autocast.device_type) if autocast is not None else contextlib.nullcontext()
    with tracing_errors(f"{type(model).__name__} with torch.export (non-strict)",
                        "make forward traceable (no data-dependent Python control flow, no .item()/.tolist() on "
                        "tensors) or pass example_inputs matching forward's signature"), quiet_unless_ok(), off:
        warn_traced_hooks(model)
        with _forward_inside(model, autocast), _NoGradReadsRefused(), cumulative_batch_norm_traceable(model), \
                _boundary_hooks(model, boundaries), custom_gradients_checked(model), \
                forward_state_unchanged(model) as state, eager_branches():
            try:
                ep = torch.export.export(model, tuple(args), kwargs or None, dynamic_shapes=dynamic_shapes,
                                         strict=False)
            except RuntimeError as e:
                raise _unknown_output_error(model, kwargs, e) or e
        state.check_constants(ep.constants)
        mark_stop_gradients(ep.graph_module)
        replace_above_autograd(ep.graph_module)
        route_exported(ep.graph_module)  # attention: one device-neutral node (fxshard/ops/attention.py)
        gm, mutated = _decomposed(ep.graph_module, decomposition_table(lambda t: STOP_GRADIENT(t)))
    return ep, gm, mutated


_DETACHING = {torch.Tensor.detach, torch.detach}


class _NoGradReadsRefused(TorchFunctionMode):
    """While a forward is exported: a ``torch.no_grad()`` region inside an enabled ``torch.autocast`` (shard()'s,
    or the model's own) that computes from a tensor needing a gradient raises a ShardingError. ``torch.export``
    keeps no grad-disabled region nested inside an autocast region (its passes inline it), so such a region's
    gradient would silently flow where eager's stops (``mark_stop_gradients`` finds nothing to mark). Regions
    over tensors that need no gradient (rotary tables from buffers and positions) lose nothing and pass;
    ``.detach()`` is an op, kept in the graph."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch.is_grad_enabled() or func in _DETACHING:
            return out
        active = [AutocastState.current(d) for d in AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]
        if (active and any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(out))
                and any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves((args, kwargs)))):
            raise ShardingError(
                f"{_caller_line()} computes under torch.no_grad() from a tensor that needs a gradient, inside "
                f"{active[0]}; torch.export drops a grad-disabled region nested in an autocast forward, so "
                f"the gradient would flow through it unlike eager's. Compute that value from .detach()-ed "
                f"tensors instead (e.g. self.proj(h.detach()) in place of the no_grad block), or shard and call "
                f"the module without autocast")
        return out


def _caller_line() -> str:
    """The innermost frame of the running stack outside torch and fxshard, as ``file:line (code)``."""
    for fr in reversed(traceback.extract_stack()):
        if f"{os.sep}torch{os.sep}" not in fr.filename and f"{os.sep}fxshard{os.sep}" not in fr.filename:
            return f"{fr.filename}:{fr.lineno} ({fr.line})"
    return "the forward"


@contextlib.contextmanager
def _forward_inside(model: torch.nn.Module, autocast: Optional[AutocastState]) -> Iterator[None]:
    """``model.forward`` runs inside ``autocast`` in the block (an instance attribute wrapping it, with its
    signature: export reads argument names from it); nothing changes without one."""
    if autocast is None:
        yield
        return
    own = model.__dict__.get("forward")
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with autocast.context():
            return inner(*args, **kwargs)

    model.__dict__["forward"] = forward
    try:
        yield
    finally:
        if own is None:
            del model.__dict__["forward"]
        else:
            model.__dict__["forward"] = own


@contextlib.contextmanager
def _traced_on(model: torch.nn.Module, args: Any, kwargs: Any, autocast: Optional[AutocastState]
               ) -> Iterator[tuple[Any, Any]]:
    """The example inputs to trace with, the model's parameters and buffers swapped for fake tensors on
    ``autocast``'s device type in the block when any of them or of the inputs lives elsewhere (a meta model:
    autocast casts nothing on the meta device), inputs made fake tensors of the same mode. Without
    ``autocast``, or when every tensor is on its device type already, nothing changes."""
    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    tensors = list(model.parameters()) + list(model.buffers())
    if autocast is None or all(t.device.type == autocast.device_type for t in tensors + leaves):
        yield args, kwargs
        return

    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    device = torch.device(autocast.device_type)
    memo: dict[int, torch.Tensor] = {}

    def fake(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in memo:
            with mode:
                t = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)
            if isinstance(x, torch.nn.Parameter):
                t = torch.nn.Parameter(t, requires_grad=x.requires_grad)
            elif x.requires_grad:
                t.requires_grad_(True)
            memo[id(x)] = t
        return memo[id(x)]

    swapped = []
    for m in model.modules():
        for table in (m._parameters, m._buffers):
            for name, t in list(table.items()):
                if t is not None:
                    swapped.append((table, name, t))
                    table[name] = fake(t)
    try:
        yield pytree.tree_map(fake, args), pytree.tree_map(fake, kwargs)
    finally:
        for table, name, t in swapped:
            table[name] = t


def trace_forward(model: torch.nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any = None,
                  boundaries: Optional[dict] = None, autocast: Optional[AutocastState] = None) -> Traced:
    """Export ``model(*args, **kwargs)`` to a decomposed core-ATen graph (see module doc).

    ``boundaries`` (module FQN -> style Boundaries) become ``fxshard::constrain`` ops at those
    modules' inputs and outputs; ``fxshard.constrain`` calls in model code are recorded too.
    ``autocast``: the forward runs inside it (``precision.py``), so the graph holds autocast's casts as
    ``_to_copy`` nodes; every tensor is then traced on that device type (autocast casts nothing on meta).
    """
    if not isinstance(model, torch.nn.Module):
        raise ShardingError(f"shard() expects an nn.Module, got {type(model).__name__}; wrap your function in a Module")
    tensors = list(model.parameters()) + list(model.buffers())
    args, kwargs = _distinct(args, kwargs)
    with _traced_on(model, args, kwargs, autocast) as (args, kwargs):
        if autocast is None:
            args, kwargs = _on_device(args, kwargs, tensors[0].device if tensors else torch.device("cpu"))
        ep, gm, mutated = _export_decomposed(model, args, kwargs, dynamic_shapes, boundaries, autocast)

    sig = ep.graph_signature
    by_id: dict[int, list[str]] = {}
    tensor_of: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
        tensor_of[name] = p
    for name, b in model.named_buffers(remove_duplicate=False):
        by_id.setdefault(id(b), []).append(name)
        tensor_of[name] = b
    non_persistent = set(sig.non_persistent_buffers) if hasattr(sig, "non_persistent_buffers") else set()

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    slots: list[Slot] = []
    first_of: dict[int, fx.Node] = {}
    keep: list[fx.Node] = []
    user_i = 0
    for node, spec in zip(placeholders, sig.input_specs):
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            t = tensor_of[spec.target]
            if id(t) in first_of:  # tied: reuse the first placeholder of the same tensor
                node.replace_all_uses_with(first_of[id(t)])
                gm.graph.erase_node(node)
                continue
            first_of[id(t)] = node
            kind = "param" if spec.kind == InputKind.PARAMETER else "buffer"
            slots.append(
                Slot(kind, list(by_id[id(t)]), persistent=spec.target not in non_persistent,
                     requires_grad=bool(getattr(t, "requires_grad", False)) and kind == "param")
            )
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            slots.append(Slot("constant", [spec.target]))
        elif spec.kind == InputKind.USER_INPUT and isinstance(spec.arg, ConstantArgument):
            if node.users:
                raise ShardingError(f"forward's non-tensor argument {node.name!r} is used as a graph input; "
                                    f"pass it as a tensor")
            gm.graph.erase_node(node)
            continue
        elif spec.kind == InputKind.USER_INPUT:
            slots.append(Slot("input", [], index=user_i))
            user_i += 1
        else:
            raise ShardingError(f"unsupported exported input kind {spec.kind} for {node.name}")
        keep.append(node)

    mutations: list[str] = []
    for i in mutated:
        spec = sig.input_specs[i]
        if spec.kind == InputKind.BUFFER:
            mutations.append(spec.target)
        else:
            raise _mutation_error(model, spec)

    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in DROP:
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm = drop_noop_clones(cse(gm, keep_casts=True))
    flag_stop_gradients(gm)

    flat, in_tree = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    constant_leaves = {i: x for i, x in enumerate(flat) if not isinstance(x, torch.Tensor)}
    if len(positions) != user_i:
        raise ShardingError(
            f"the exported program takes {user_i} tensor inputs but the example inputs hold {len(positions)} tensors; "
            f"pass tensors for every tensor argument of forward"
        )
    return Traced(
        gm=gm,
        slots=slots,
        in_tree=in_tree,
        out_tree=ep.call_spec.out_spec,
        constants=dict(ep.constants),
        n_user_leaves=len(flat),
        mutations=mutations,
        tensor_leaf_positions=positions,
        constant_leaves=constant_leaves,
    )
