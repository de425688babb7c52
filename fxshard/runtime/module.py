"""``ShardedModule``: the per-rank nn.Module that ``fxshard.shard`` returns."""

from __future__ import annotations

import functools
import sys
import types
import warnings
import weakref
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.autograd import forward_ad as _forward_ad
from torch.nn.utils.parametrize import is_parametrized
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from ..comm.failures import run_program
from .description import Sharding
from ..core.errors import ShardingError, name_few
from ..state.grad_norm import clip_grad_norm_ as _clip_grad_norm
from .inputs import InputCheck
from ..core.precision import AutocastState, autocast_off, check_autocast
from ..tracing.captured import Captured, check_captured
from ..state.grad_guard import forward_started, record_gradients, track_gradients
from ..state.optim_state import track_optimizers
from ..core.mesh import MeshInfo
from ..tracing.export import Traced
from ..state.checkpoint import (
    Piece, assemble, global_view, held_pieces, local_piece, open_checkpoint, storage, take,
)
from ..core.placements import Pl, R, S
from ..comm.replicas import as_words, check_pieces_differ, check_replicas, communicates, from_source, holds_sentinel
from .sources import SHARED
from ..state.tiled_init import draw_seed, fill as fill_tiles
from ..core.torch_compat import dynamo_safe_function_outputs, peek_interpreter_stack

__all__ = ["ShardedModule", "Scope", "ScopeList", "ScopeDict", "Program", "Programs", "Training", "Untrainable"]


@dataclass
class Program:
    """One sharded graph with what explain/comm_stats need to describe it."""

    gm: fx.GraphModule
    label: str
    fallbacks: list[str] = field(default_factory=list)


@dataclass
class Training:
    """The sharded joint graph split into the programs autograd runs."""

    fwd: Program
    bwd: Program
    n_out: int
    diff_out: list[int]
    diff_in: list[int]
    updated: list[int] = field(default_factory=list)  # primals: buffers the forward updates in place
    grad_out: Optional[list[int]] = None  # outputs that need a gradient (None: every one of diff_out)
    reaches: Optional[list[frozenset[int]]] = None  # per diff_in: the grad_out reaching it (None: all)


@dataclass
class Untrainable:
    """Why there is no training program although primals ``diff_in`` want a gradient: a gradient would reach a
    collective the model calls itself (``passes.joint.CollectiveGradient``), which eager autograd cannot
    differentiate either. As in eager, the forward still runs (the inference program); ``error`` is raised by the
    backward of a call whose outputs need a gradient (``_NoGradient``)."""

    error: ShardingError
    diff_in: list[int]


@dataclass
class Programs:
    """Everything that runs for one combination of module modes (``training`` of each submodule)."""

    traced: Traced
    forward: Program
    training: Optional[Training]
    input_check: InputCheck
    untrainable: Optional[Untrainable] = None  # set where training is None because no training program exists


@dataclass(frozen=True)
class _Views:
    """Differentiable outputs of the forward program that are views of one tensor, the root (as eager's are: an
    output and ``out.view(...)`` or ``out[:, :4]`` of it, or views of one intermediate). ``_RunSharded`` returns
    the root at ``slot`` instead (an autograd.Function's outputs that are views cannot be written in place), and
    ``ShardedModule._run`` rebuilds each member ``(output index, size, stride, storage offset)`` as a view of it,
    so autograd tracks them as views, as in eager."""

    slot: int
    members: tuple[tuple[int, tuple[int, ...], tuple[int, ...], int], ...]
    root: tuple[tuple[int, ...], tuple[int, ...], int]  # the root's size, stride, storage offset


class _RunSharded(torch.autograd.Function):
    """Runs the sharded forward program; its backward runs the sharded backward program.

    ``views`` (empty) receives the ``_Views`` groups whose members the caller must rebuild from the returned
    roots (see ``_Views``); the Function returns ``training.n_out`` outputs (members as None), then the roots
    that are not outputs themselves."""

    @staticmethod
    def forward(ctx, training: Training, where: str, views: list, *primals: Any) -> Any:  # type: ignore[override]
        res = run_program(training.fwd.gm, primals, f"the forward of {where}")
        outs, saved = list(res[: training.n_out]), list(res[training.n_out:])
        if training.updated:  # a buffer the backward reads is saved as its value now: it is updated next
            bufs = [primals[i] for i in training.updated]
            saved = [x.clone() if isinstance(x, torch.Tensor) and any(x is b or x._base is b for b in bufs) else x
                     for x in saved]
            # here, not after apply returns: non-reentrant checkpoint's recompute stops (raises) when the saved
            # tensors are packed, and eager's recompute updates the buffers (BatchNorm's running statistics)
            _write_buffers(bufs, outs)
        ctx.training = training
        ctx.where = where
        ctx.device_type = next((x.device.type for x in primals if isinstance(x, torch.Tensor)), "cpu")
        ctx.tensor_pos = [i for i, x in enumerate(saved) if isinstance(x, torch.Tensor)]
        ctx.others = [None if isinstance(x, torch.Tensor) else x for x in saved]
        ctx.save_for_backward(*[saved[i] for i in ctx.tensor_pos])
        ctx.out_meta = [(o.shape, o.dtype, o.device) if isinstance(o, torch.Tensor) else None for o in outs]
        diff = set(training.diff_out if training.grad_out is None else training.grad_out)
        # compared with ``is``, not through id(): TorchDynamo before torch 2.13 cannot trace id() of these
        kept = [_root(o) for i, o in enumerate(outs) if i in diff and isinstance(o, torch.Tensor)]
        for i, o in enumerate(outs):  # a .detach()-ed copy of an output (or a view of it) shares its storage
            if isinstance(o, torch.Tensor) and i not in diff and any(_root(o) is k for k in kept):
                outs[i] = o.detach()
        ctx.mark_non_differentiable(*[o for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and i not in diff])
        ctx.set_materialize_grads(False)  # None: an output the loss does not use (see backward)
        ctx.views = []
        if not torch.compiler.is_compiling():  # under TorchDynamo, AOTAutograd regenerates aliased outputs itself
            groups = _view_groups(outs, sorted(diff), primals)
            ctx.views = [group for group, _ in groups]
            views.extend(ctx.views)
            for group, root in groups:
                for member in group.members:
                    outs[member[0]] = None
                if group.slot < training.n_out:
                    outs[group.slot] = root
            outs += [root for group, root in groups if group.slot >= training.n_out]
        return tuple(dynamo_safe_function_outputs(outs, diff))

    @staticmethod
    def backward(ctx, *grad_outs: Any) -> Any:  # type: ignore[override]
        if torch.is_grad_enabled():  # the autograd engine runs a backward under create_graph=True with grad on
            raise ShardingError(
                f"{ctx.where}: a backward with create_graph=True (a gradient penalty, a Hessian-vector product) "
                f"differentiates through this module's backward, but the module runs its sharded backward "
                f"program as one step that is not itself differentiable, so second-order gradients would be "
                f"wrong. Shard the whole computation with fxshard.jit instead (torch.func.grad nested inside "
                f"the function), or take the second derivative of the unsharded model")
        tr: Training = ctx.training
        saved = list(ctx.others)
        for i, t in zip(ctx.tensor_pos, ctx.saved_tensors):
            saved[i] = t
        grad_outs = _member_grads(grad_outs, ctx.views, tr.n_out)
        tangents = []
        for i in tr.diff_out:
            g = grad_outs[i]
            if g is None:
                shape, dtype, device = ctx.out_meta[i]
                g = torch.zeros(shape, dtype=dtype, device=device)
            tangents.append(g.contiguous())
        with autocast_off(ctx.device_type):  # the program holds the casts autocast's backward would make
            grads = run_program(tr.bwd.gm, (*saved, *tangents), f"the backward of {ctx.where}")
        n_primals = len(ctx.needs_input_grad) - 3
        res: list[Any] = [None] * n_primals
        used = {i for i, g in enumerate(grad_outs) if g is not None}
        for k, (pos, g) in enumerate(zip(tr.diff_in, grads)):
            # as eager: no gradient (None, not zeros) for what no output used in the loss reaches
            res[pos] = g if tr.reaches is None or tr.reaches[k] & used else None
        return (None, None, None, *res)


class _NoGradient(torch.autograd.Function):
    """Runs the inference program of a module without a training program (``Untrainable``) on a call that needs
    gradients: its floating outputs past the ``n_mut`` buffer updates need a gradient, as eager's do, and the
    backward raises the ShardingError saying why there is none (eager's would be silently wrong)."""

    @staticmethod
    def forward(ctx, untrainable: Untrainable, gm: fx.GraphModule, where: str, n_mut: int,  # type: ignore[override]
                *primals: Any) -> Any:
        outs = run_program(gm, primals, f"the forward of {where}")
        ctx.error, ctx.where = untrainable.error, where
        ctx.mark_non_differentiable(*[o for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and (
            i < n_mut or not o.is_floating_point())])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outs: Any) -> Any:  # type: ignore[override]
        raise ShardingError(f"{ctx.where}: its forward ran (as eager's does) but it has no backward, because "
                            f"{ctx.error}") from ctx.error


def _one_value(p: torch.Tensor) -> bool:
    """Whether every element of this rank's piece of ``p`` is the same value (a constant fill)."""
    t = p.to_local() if isinstance(p, DTensor) else p
    with torch.no_grad():
        return t.numel() == 0 or bool((t == t.reshape(-1)[0]).all())


_SAMPLES = 16  # elements of a piece _written_state compares


def _written_state(p: torch.Tensor) -> Optional[tuple[int, int, list]]:
    """What tells that this rank's piece of ``p`` was written: the tensor's identity, its version counter and the
    bits of a few elements spread over it (writes through ``p.data``, HF's ``module.weight.data.normal_()``, do
    not move ``p``'s version counter); None for a tensor it cannot read (a DTensor, meta)."""
    if isinstance(p, DTensor) or p.is_meta:
        return None
    flat = p.detach().reshape(-1)
    n, k = flat.numel(), min(_SAMPLES, flat.numel())
    sample = flat[torch.tensor([i * (n - 1) // max(k - 1, 1) for i in range(k)], dtype=torch.long, device=flat.device)]
    return id(p), p._version, as_words(sample).tolist()


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage ``t`` views (``t`` itself when it is not a view)."""
    return t if t._base is None else t._base


def _view_groups(outs: list, diff: Sequence[int], primals: Sequence[Any]) -> list[tuple[_Views, torch.Tensor]]:
    """Each group of differentiable outputs (``outs[i]`` for ``i`` in ``diff``) that view one root the program
    made (views of an input are left as they are), with the root. A group's slot is the first output that is
    the root itself, else the next place past the outputs. Requires ``outs`` as the program returned them."""
    given = {id(_root(p)) for p in primals if isinstance(p, torch.Tensor)}  # an input may itself be a view
    roots: dict[int, torch.Tensor] = {}
    for i in diff:
        o = outs[i]
        if isinstance(o, torch.Tensor) and o._base is not None and id(o._base) not in given:
            roots.setdefault(id(o._base), o._base)
    groups: list[tuple[_Views, torch.Tensor]] = []
    extra = len(outs)
    for root in roots.values():
        members = [i for i in diff if isinstance(outs[i], torch.Tensor) and (outs[i] is root or outs[i]._base is root)]
        slot = next((i for i in members if outs[i] is root), None)
        if slot is None:
            slot, extra = extra, extra + 1
        geometry = tuple((i, tuple(outs[i].shape), outs[i].stride(), outs[i].storage_offset()) for i in members)
        groups.append((_Views(slot, geometry, (tuple(root.shape), root.stride(), root.storage_offset())), root))
    return groups


def _member_grads(grad_outs: Sequence[Any], groups: Sequence[_Views], n_out: int) -> list[Any]:
    """Per output of the program, the gradient to hand its backward: the Function's own for outputs outside
    ``groups``; for a group's members, pieces of the gradient of their root (``grad_outs[group.slot]``).

    Requires: each member ``i`` is ``V_i(root)`` for a strided view ``V_i`` (the identity for the root itself).
    Ensures: ``sum_i V_i^T(piece_i)`` is the root's gradient, so the backward program, linear in its output
    gradients, gives the inputs' gradients through the root. A root that is an output takes it whole (the
    other members nothing); else it is split among the members' elements that view each position (the root
    is not an output then, so its gradient comes only through the members)."""
    grads = list(grad_outs[:n_out])
    for group in groups:
        for (i, *_), piece in zip(group.members, _split_root_grad(grad_outs[group.slot], group)):
            grads[i] = piece
    return grads


def _split_root_grad(g: Optional[torch.Tensor], group: _Views) -> list[Optional[torch.Tensor]]:
    """``g`` (the gradient of ``group``'s root, or None) as pieces per member (see ``_member_grads``)."""
    if g is None:
        return [None] * len(group.members)
    if group.slot in [i for i, *_ in group.members]:
        return [g if i == group.slot else None for i, *_ in group.members]
    shape, stride, offset = group.root
    start = min(offset, *(off for *_, off in group.members))
    views = [(size, st, off - start) for _, size, st, off in group.members]
    span = max(offset - start + _extent(shape, stride), *(off + _extent(size, st) for size, st, off in views))
    if start == offset and span == g.numel() and g.is_contiguous() and g.stride() == tuple(stride):
        flat = g.view(-1)  # laid out as the root: storage position p holds flat[p - offset]
    else:
        flat = g.new_zeros(span)
        flat.as_strided(shape, stride, offset - start).copy_(g)
    if len(views) == 1 and _no_self_overlap(*views[0][:2]):
        return [flat.as_strided(*views[0])]
    count = g.new_zeros(span)  # how many members' elements view each position
    for size, st, off in views:
        if _no_self_overlap(size, st):
            count.as_strided(size, st, off).add_(1)
        else:
            index = torch.arange(span, device=g.device).as_strided(size, st, off).reshape(-1)
            count.index_add_(0, index, torch.ones(index.numel(), dtype=g.dtype, device=g.device))
    flat = flat / count.clamp(min=1)
    return [flat.as_strided(size, st, off) for size, st, off in views]


def _extent(size: Sequence[int], stride: Sequence[int]) -> int:
    """How many storage elements a strided view spans (0 if it is empty)."""
    return 0 if 0 in size else 1 + sum((n - 1) * st for n, st in zip(size, stride))


def _no_self_overlap(size: Sequence[int], stride: Sequence[int]) -> bool:
    """True if no two elements of the strided view share a storage position (a sufficient test: each
    stride, smallest first, passes the span of the smaller ones)."""
    reach = 0
    for st, n in sorted((st, n) for n, st in zip(size, stride) if n > 1):
        if st <= reach:
            return False
        reach += st * (n - 1)
    return True


def _write_buffers(buffers: Sequence[torch.Tensor], outs: Sequence[Any]) -> None:
    """Copy a program's first outputs (the new values of the buffers its forward updates in place, e.g. BatchNorm
    running statistics, in ``Traced.mutations`` order) into ``buffers`` (the registered tensors, same order)."""
    with torch.no_grad():
        for buf, new in zip(buffers, outs):
            buf.copy_(new)


class _StandIn(nn.Module):
    """A module standing in for one of the original model's (a ShardedModule for the model, a Scope for a
    submodule). The plain attributes the original had when traced (``_keep_traced``) were constants to the
    programs: setting one raises (``_refuse_traced``); reading one gives its value then if that is immutable (a
    dropout's ``p``, an embedding's ``sparse``, which DDP reads), else explains why it is not here
    (``_traced_attribute``: an HF model's ``config``). Replacing a submodule's stand-in raises
    (``_refuse_replacing``)."""

    def __setattr__(self, name: str, value: Any) -> None:
        _refuse_traced(self, name)
        if value is None or isinstance(value, nn.Module):
            _refuse_replacing(self, name, value)
        super().__setattr__(name, value)

    def add_module(self, name: str, module: Optional[nn.Module]) -> None:
        _refuse_replacing(self, name, module)
        super().add_module(name, module)

    def train(self, mode: bool = True) -> "_StandIn":
        """``nn.Module.train``; where the original's class overrides it (a backbone keeping its BatchNorms in eval,
        freezing a stage), that override instead, run on the model's meta copy (``_TRAIN_OVERRIDES``), and this
        subtree takes the modes and ``requires_grad`` flags it leaves, as eager's ``model.train()`` runs it."""
        override = _TRAIN_OVERRIDES.get(self)
        if override is None:
            return super().train(mode)
        mods, params = dict(self.named_modules()), dict(self.named_parameters())
        after = override(mode, {n: m.training for n, m in mods.items()},
                         {n: p.requires_grad for n, p in params.items()})
        if after is None:
            warnings.warn(f"fxshard: {type(self).__name__}.train overrides nn.Module.train, but fxshard kept no copy of "
                          f"the model to run it on, so only nn.Module.train ran: set the modes it would set on the "
                          f"stand-ins yourself (sm.<submodule>.eval())", stacklevel=2)
            return super().train(mode)
        modes, grads = after
        for n, flag in modes.items():
            if n in mods and mods[n].training != flag:
                mods[n].training = flag
        for n, flag in grads.items():
            if n in params and params[n].requires_grad != flag:
                params[n].requires_grad_(flag)
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            values = self.__dict__.get("_traced_values", {})
            if name in values:
                return values[name]
            raise _traced_attribute(self, name) from None


# a stand-in (or ShardedModule) whose original's class overrides nn.Module.train -> that override, run on the
# model's meta copy (api._resharder): kept here, not on the stand-in, which pickles alone (a closure does not)
_TRAIN_OVERRIDES: "weakref.WeakKeyDictionary[nn.Module, Callable[..., Optional[tuple[dict, dict]]]]" = \
    weakref.WeakKeyDictionary()


def _register_train_overrides(sm: "ShardedModule") -> None:
    """Ensures: each stand-in of ``sm`` whose original class overrides ``train`` (``sm._train_overrides``) finds it."""
    for fqn, override in sm.__dict__.get("_train_overrides", {}).items():
        _TRAIN_OVERRIDES[sm.get_submodule(fqn)] = override


class Scope(_StandIn):
    """Stands in a ShardedModule for one submodule of the original model: it holds that submodule's
    local parameters and buffers and its train/eval mode (``sm.dropout.eval()`` works as on the model).

    Its class is made per original class (``_stand_in_class``): a subclass of both, named like it, so code
    that selects modules by type (``isinstance(m, nn.LayerNorm)``, ``type(m).__name__``) finds it as on the
    model. What runs is the stand-in's: nn.Module's methods (``train``, ``apply``, ``state_dict``, ...) even
    where the original class overrides them, and none of the original class's own methods and properties
    (they would compute with this rank's pieces): those raise a ShardingError (``_guard``).

    It is not called (the ShardedModule runs the whole model as one program), so hooks that would wait
    for its call raise a ShardingError at registration, except FSDP2's: ``fully_shard(sm.layers[i])``
    works (the ShardedModule drives those hooks around its program, see ``ShardedModule.forward``)."""

    def __init__(self, kind: str = "Module", fqn: str = "") -> None:
        super().__init__()
        self._kind = kind
        self._fqn = fqn

    def _get_name(self) -> str:
        return self._kind

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ShardingError(f"the {self._kind} {self._fqn!r} inside a ShardedModule cannot run on its own: fxshard "
                            f"shards the whole model as one program; call the ShardedModule (or shard this submodule "
                            f"itself). For activation checkpointing of its layers use shard(..., remat='layers')")

    def _no_hooks(self, what: str, hook: Any) -> None:
        if _is_fsdp(getattr(hook, "__self__", None), "_fsdp_state", "FSDPState"):
            return
        raise ShardingError(
            f"{what} on the {self._kind} {self._fqn!r} inside a ShardedModule would never fire: fxshard runs the whole "
            f"model as one program, so its submodules are never called. Register the hook on the ShardedModule itself "
            f"(its local inputs and outputs), return the value you need from the model's forward (out_specs give its "
            f"layout), or shard that submodule on its own; for activation checkpointing use shard(..., remat='layers'), "
            f"for FSDP2 per layer fully_shard(sm.<layer>) works as is")

    def register_forward_pre_hook(self, hook: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        self._no_hooks("a forward pre-hook", hook)
        return super().register_forward_pre_hook(hook, **kwargs)

    def register_forward_hook(self, hook: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        self._no_hooks("a forward hook", hook)
        return super().register_forward_hook(hook, **kwargs)

    def register_full_backward_pre_hook(self, hook: Any, prepend: bool = False) -> Any:  # type: ignore[override]
        self._no_hooks("a backward pre-hook", hook)
        return super().register_full_backward_pre_hook(hook, prepend)

    def register_full_backward_hook(self, hook: Any, prepend: bool = False) -> Any:  # type: ignore[override]
        self._no_hooks("a backward hook", hook)
        return super().register_full_backward_hook(hook, prepend)

    def register_backward_hook(self, hook: Any) -> Any:  # type: ignore[override]
        self._no_hooks("a backward hook", hook)
        return super().register_backward_hook(hook)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickles (and copies) a stand-in by its stand-in kind and original class, which find its class again
        (``_stand_in_class``): the generated class itself cannot be found by name."""
        made = type(self).__dict__.get("_stand_in_of")
        if made is None:  # a plain Scope, or FSDP2's subclass of a stand-in class (FSDP2 refuses copies itself)
            return super().__reduce_ex__(protocol)
        return _remake_stand_in, made, self.__getstate__()


class ScopeList(Scope):
    """The stand-in of an ``nn.ModuleList``/``nn.Sequential``: indexed, sliced, iterated and sized like it
    (``sm.layers[0]``, ``for layer in sm.layers``, ``len(sm.layers)``)."""

    def __getitem__(self, idx: int | slice) -> Any:
        items = list(self._modules.values())
        if isinstance(idx, slice):
            return items[idx]
        if not isinstance(idx, int) or not -len(items) <= idx < len(items):
            raise ShardingError(f"{self._kind} {self._fqn!r} has {len(items)} modules; index {idx!r} is not one of them")
        return items[idx]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Any:
        return iter(list(self._modules.values()))


class ScopeDict(Scope):
    """The stand-in of an ``nn.ModuleDict``: ``sm.blocks["a"]``, ``in``, ``len``, ``keys``/``values``/``items``."""

    def __getitem__(self, key: str) -> Any:
        if key not in self._modules:
            raise ShardingError(f"{self._kind} {self._fqn!r} has no module {key!r}; it has {list(self._modules)}")
        return self._modules[key]

    def __contains__(self, key: str) -> bool:
        return key in self._modules

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Any:
        return iter(list(self._modules))

    def keys(self) -> Any:
        return list(self._modules)

    def values(self) -> Any:
        return list(self._modules.values())

    def items(self) -> Any:
        return list(self._modules.items())


def _scope(kind: type, fqn: str, traced: Mapping[str, Any]) -> Scope:
    """The stand-in of a submodule of type ``kind`` (subclasses of the containers included) whose plain
    attributes ``traced`` (name -> value) were constants to the trace: an instance of ``kind`` (see
    ``_stand_in_class``)."""
    base = (ScopeList if issubclass(kind, (nn.ModuleList, nn.Sequential)) else
            ScopeDict if issubclass(kind, nn.ModuleDict) else Scope)
    scope = _stand_in_class(base, kind)(kind.__name__, fqn)
    _keep_traced(scope, traced)
    return scope


_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
              torch.memory_format)


def _keep_traced(m: nn.Module, traced: Mapping[str, Any]) -> None:
    """Records on the stand-in ``m`` the plain attributes (name -> value) its original had when traced: their
    names (``_traced_attrs``: setting one raises) and the values of the immutable ones (``_traced_values``:
    numbers, strings, None, dtypes, devices and tuples of them, read as on the original)."""
    m._traced_attrs = frozenset(traced)
    m._traced_values = {name: value for name, value in traced.items() if _immutable(value)}


def _immutable(value: Any) -> bool:
    """Whether ``value`` is one of ``_IMMUTABLE``'s types, or a tuple or frozenset of such values."""
    if isinstance(value, (tuple, frozenset)):
        return all(_immutable(v) for v in value)
    return isinstance(value, _IMMUTABLE)


# ---- stand-in classes ----------------------------------------------------------------------------------------
# A stand-in for a module of class C has a generated class also named C, with bases (stand-in kind, C's guard),
# so its MRO is: generated C, Scope (or ScopeList/ScopeDict), _StandIn, _CGuard, C, C's bases, nn.Module, (C's
# mixins), object:
# the stand-in's own methods come first, then the guard, which overrides everything C's classes define (all
# but nn.Module and object) with nn.Module's version or a ShardingError (``_guard_entry``); the stand-in
# classes' own super() calls reach the guard too, so none of C's code runs on the stand-in.

_STAND_IN_CLASSES: dict[tuple[type, type], type] = {}
_GUARDS: dict[type, type] = {}
_INHERIT = object()  # _guard_entry: leave the original class's attribute as it is
# what Python reads off a class itself (never overridden)
_CLASS_MACHINERY = frozenset({
    "__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__slots__", "__annotations__",
    "__annotate__", "__abstractmethods__", "_abc_impl", "__orig_bases__", "__parameters__", "__static_attributes__",
    "__firstlineno__", "__type_params__", "__init_subclass__", "__class_getitem__", "__subclasshook__"})
# what every module instance, and a stand-in, holds in its __dict__: a class attribute of that name is never read
_INSTANCE_NAMES = frozenset(vars(nn.Module())) | {"_kind", "_fqn", "_traced_attrs", "_traced_values"}
_MODULE_CLASS_ATTRS = {name: value for klass in reversed(nn.Module.__mro__) for name, value in vars(klass).items()}


def _stand_in_class(kind: type, orig: type) -> type:
    """The class of the stand-ins of kind ``kind`` (Scope, ScopeList, ScopeDict) for modules of class ``orig``.

    Ensures: a subclass of ``kind`` and of ``orig``, named like ``orig`` (``__name__``, ``__qualname__``), one per
    ``(kind, orig)``; its instances behave as ``kind``'s (see the MRO above). If Python cannot make such a class
    (``orig``'s ``__init_subclass__`` or layout refuses it: a TypeError), ``kind`` itself, with a warning."""
    key = (kind, orig)
    cls = _STAND_IN_CLASSES.get(key)
    if cls is None:
        ns = {"__module__": __name__, "__qualname__": orig.__qualname__, "_stand_in_of": key,
              "__doc__": f"A {kind.__name__} standing in for a {orig.__module__}.{orig.__qualname__} (see Scope)."}
        try:
            cls = types.new_class(orig.__name__, (kind, _guard(orig)), exec_body=lambda d: d.update(ns))
        except TypeError as e:
            warnings.warn(f"the stand-ins of {orig.__qualname__} modules inside a ShardedModule are not instances of "
                          f"{orig.__qualname__} (isinstance() is False for them): Python could not subclass it ({e})",
                          stacklevel=4)
            cls = kind
        _STAND_IN_CLASSES[key] = cls
    return cls


def _remake_stand_in(kind: type, orig: type) -> Scope:
    """An empty stand-in of ``_stand_in_class(kind, orig)`` (unpickling, copying: its state is set next)."""
    cls = _stand_in_class(kind, orig)
    return cls.__new__(cls)


def _guard(orig: type) -> type:
    """The subclass of ``orig`` that overrides, for every attribute the classes of ``orig``'s MRO other than
    nn.Module and object define, what a stand-in uses instead (``_guard_entry``); one per ``orig``."""
    guard = _GUARDS.get(orig)
    if guard is None:
        ns: dict[str, Any] = {"__module__": __name__, "__qualname__": f"_{orig.__name__}Guard"}
        seen: set[str] = set()
        for klass in orig.__mro__:
            if klass is nn.Module or klass is object:
                continue
            for name, value in vars(klass).items():
                if name not in seen:
                    seen.add(name)
                    entry = _guard_entry(orig, name, value)
                    if entry is not _INHERIT:
                        ns[name] = entry
        guard = _GUARDS[orig] = types.new_class(ns["__qualname__"], (orig,), exec_body=lambda d: d.update(ns))
    return guard


def _guard_entry(orig: type, name: str, value: Any) -> Any:
    """What the guard of ``orig`` defines for ``name`` (``value`` in the first class of ``orig``'s MRO that
    defines it), or ``_INHERIT``:

    - nn.Module's (or object's) own ``name`` where it has one: ``train``, ``eval``, ``to``, ``_apply``,
      ``__setattr__``, ``_load_from_state_dict``, ``extra_repr``, ``__repr__``, ... (``_version``, the state dict
      format, stays the original class's);
    - ``orig``'s own class constants (neither callable nor descriptors, or classes: HF's ``base_model_prefix``,
      ``_no_split_modules``, ``config_class``) stay readable and cannot be set (``_ClassConstant``);
    - ``orig``'s own methods and properties (``reset_parameters``, ``_init_weights``, a parametrization's
      ``weight``) raise a ShardingError when called or read (``_blocked_method``, ``_blocked_attribute``)."""
    if name in _CLASS_MACHINERY or name in _INSTANCE_NAMES or name == "_version":
        return _INHERIT
    if name == "__new__":  # object.__new__ itself would refuse the stand-in's arguments
        return staticmethod(_plain_new)
    if name in _MODULE_CLASS_ATTRS:
        return _MODULE_CLASS_ATTRS[name]
    if name in ("__copy__", "__deepcopy__"):  # copy falls back to Scope.__reduce_ex__
        return None
    if name == "__del__":
        return _no_finalizer
    dunder = name.startswith("__") and name.endswith("__")
    if isinstance(value, type) or not (callable(value) or hasattr(type(value), "__get__")):
        return _INHERIT if dunder else _ClassConstant(name, value)
    if isinstance(value, (staticmethod, classmethod)) or (callable(value) and not hasattr(type(value), "__set__")):
        return _blocked_method(orig, name)
    return _blocked_attribute(orig, name)


def _plain_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``__new__`` of a stand-in class whose original defines its own: an empty instance, as nn.Module's."""
    return object.__new__(cls)


def _no_finalizer(self: Any) -> None:
    """A stand-in has none of the resources an original ``__del__`` releases."""


class _ClassConstant:
    """A class constant of the original class (see ``_guard_entry``): read as on the original, except where the
    original module had its own value of that name when traced (then that value, or the AttributeError of
    ``_traced_attribute``, never the class's default: see ``_StandIn``); setting it raises (``_unchanged``)."""

    def __init__(self, name: str, value: Any) -> None:
        self.name, self.value = name, value

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is not None and self.name in obj.__dict__.get("_traced_attrs", ()):
            raise AttributeError(self.name)  # the stand-in's __getattr__ answers
        return self.value

    def __set__(self, obj: Any, value: Any) -> None:
        raise _unchanged(_stand_in_name(obj), self.name)


def _blocked_method(orig: type, name: str) -> Callable[..., Any]:
    """A method that raises ``_original_code`` when called (the attribute itself exists, as on the original)."""
    def blocked(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise _original_code(self, orig, name, "cannot run")
    blocked.__name__, blocked.__qualname__ = name, f"{orig.__qualname__}.{name}"
    return blocked


def _blocked_attribute(orig: type, name: str) -> property:
    """A property that raises ``_original_code`` when read or set."""
    def read(self: Any) -> Any:
        raise _original_code(self, orig, name, "(a property) cannot be read")

    def write(self: Any, value: Any) -> None:
        raise _original_code(self, orig, name, "(a property) cannot be set")
    return property(read, write)


def _original_code(m: Any, orig: type, name: str, what: str) -> ShardingError:
    """Why ``orig``'s own ``name`` does not run on the stand-in ``m`` (see ``_guard_entry``), and what to do."""
    where = _stand_in_name(m) if isinstance(m, Scope) else f"a stand-in of {orig.__qualname__}"
    lowered = name.lower()
    if "init" in lowered or lowered.lstrip("_").startswith("reset"):
        why = ("an initializer would see this rank's local shapes (and a random one draw the same numbers on every "
               "rank)")
        fix = ("Initialize on the ShardedModule with sm.init_parameters(fn) (fn(name, t) sees each tensor at its "
               "global shape) or sm.load_full_state_dict(...), or initialize the original model before shard()")
    else:
        why = "its code would compute with those pieces or fail"
        fix = (f"Use {name} on the original model (read its attributes there; shard again to change what the "
               f"ShardedModule computes)")
    return ShardingError(
        f"{orig.__qualname__}.{name} {what} on {where}: the stand-in holds only this rank's pieces of the module's "
        f"parameters and buffers, so {why}. {fix}")


def _stand_in_name(m: nn.Module) -> str:
    """How to name the stand-in ``m`` (a ShardedModule or a Scope) in a message."""
    return m._where if isinstance(m, ShardedModule) else f"the {m._kind} {m._fqn!r} inside a ShardedModule"


def _traced_owner(m: nn.Module, name: str) -> str:
    """How to name ``m`` (a ShardedModule or a Scope) in a message if ``name`` is one of the plain attributes the
    module it stands in for had when traced; empty otherwise."""
    if name not in m.__dict__.get("_traced_attrs", ()):
        return ""
    return _stand_in_name(m)


def _refuse_traced(m: nn.Module, name: str) -> None:
    """Raises ShardingError if ``name`` is one of the plain attributes (a dropout's ``p``, a norm's ``eps``)
    the module ``m`` (a ShardedModule or a Scope) stands in for had when it was traced: the programs hold their
    values, so setting one on the stand-in would silently change nothing."""
    what = _traced_owner(m, name)
    if what:
        raise _unchanged(what, name)


def _refuse_replacing(m: nn.Module, name: str, new: Optional[nn.Module]) -> None:
    """Raises ShardingError if ``new`` would replace the stand-in ``m.<name>`` of a submodule of the original
    model (``sm.bn = SyncBatchNorm(...)``, as convert_sync_batchnorm or a LoRA/freezing utility does, finding
    the stand-in by type): the programs keep computing the original module, so the swap would change nothing."""
    old = m.__dict__.get("_modules", {}).get(name)
    if isinstance(old, Scope) and new is not old:
        raise ShardingError(
            f"replacing {_stand_in_name(old)} with {type(new).__name__ if new is not None else 'None'} would "
            f"change nothing: the programs were traced from the original model's modules and keep computing "
            f"them (with these parameters). Make the change on the original model (e.g. "
            f"nn.SyncBatchNorm.convert_sync_batchnorm(model)) and shard it again")


def _unchanged(what: str, name: str) -> ShardingError:
    """Setting ``name`` on the stand-in ``what`` (named by ``_stand_in_name``) would change nothing."""
    return ShardingError(
        f"setting {name!r} on {what} would change nothing: the programs were traced from the original module "
        f"and hold the value its {name!r} had then. Set {name!r} on the original model and shard it again "
        f"(train/eval modes are the exception: sm.train()/sm.eval() are followed)")


def _traced_attribute(m: nn.Module, name: str) -> AttributeError:
    """Why ``name`` (a plain attribute of the module ``m`` stands in for whose value is mutable, e.g. an HF
    model's ``config``) is not on the stand-in, or torch's AttributeError for anything else."""
    what = _traced_owner(m, name)
    if what:
        return AttributeError(
            f"{what} does not carry the original module's plain attribute {name!r}: its value is mutable, the "
            f"programs were traced with the value it had then, and a copy here could be changed in place to no "
            f"effect (a stand-in carries numbers, strings, None, dtypes and tuples of them). Read it from the "
            f"original model (and shard again to change it)")
    return AttributeError(f"{type(m).__name__!r} object has no attribute {name!r}")


def _container(root: nn.Module, path: list[str]) -> nn.Module:
    m = root
    for part in path:
        if not hasattr(m, part) or not isinstance(getattr(m, part), nn.Module):
            m.add_module(part, Scope())  # a parameter's owner the model tree did not list
        m = getattr(m, part)
    return m


def _describe(spec: Any) -> str:
    """A readable pytree structure (for call-structure errors)."""
    if spec.is_leaf():
        return "one value"
    kind = getattr(spec.type, "__name__", str(spec.type))
    if spec.type is dict:
        return f"a dict with keys {list(spec.context)}"
    if spec.type is type(None):
        return "None"
    return f"a {kind} of {spec.num_children} items"


_MODULE_FIX = ("Pass the value to forward as a tensor input, keep it in a buffer, or shard the model again after "
               "changing it")


def _short(value: Any) -> str:
    """``value`` for a message: a tensor by its shape and dtype, anything else by a repr of at most 80 chars."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)} ({value.dtype})"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _arg_name(args: tuple, kwargs: dict, pos: int) -> str:
    """``positional argument 0[1]`` / ``keyword argument 'mask'`` for flattened leaf ``pos`` of ``(args, kwargs)``."""
    path = pytree.tree_flatten_with_path((tuple(args), kwargs))[0][pos][0]
    head, first, rest = path[0], path[1], path[2:]
    base = f"positional argument {first.idx}" if head.idx == 0 else f"keyword argument {first.key!r}"
    return base + pytree.keystr(rest)


def _same_constant(value: Any, example: Any) -> bool:
    """Whether a non-tensor call argument equals the example the program was specialized to (``1 != True``)."""
    return type(value) is type(example) and (value == example or value is example)


class ShardedModule(_StandIn):
    """This rank's part of a sharded model.

    Parameters and buffers are the local shards, registered under the
    original FQNs (tied parameters are one Parameter under each name), and
    every submodule of the original model has a stand-in (:class:`Scope`) under
    its FQN that owns its local shards; stand-ins of containers index and
    iterate (:class:`ScopeList`, :class:`ScopeDict`), and FSDP2's
    ``fully_shard`` applies to them (see ``forward``). ``forward`` takes this rank's local inputs (laid out per
    ``in_specs``) and returns local outputs (per ``out_specs``, replicated by
    default).

    Modes follow eager: ``sm.train()``, ``sm.eval()`` and a submodule's
    ``sm.dropout.eval()`` change what the next call computes (dropout,
    BatchNorm statistics, any ``self.training`` branch). So does unfreezing a
    parameter (``sm.l1.weight.requires_grad_(True)`` after shard() trains it;
    freezing one needs no new program). The programs are traced for the modes
    and trainable parameters the model had at ``shard()``; the first call in a
    combination not seen before traces and shards the model again for it (a
    collective, so every rank must make the same change) and caches the
    programs per combination.
    """

    def __init__(self, programs: Programs, *, mesh: DeviceMesh, info: MeshInfo, placements: dict[str, tuple[Pl, ...]],
                 global_shapes: dict[str, tuple], tensors: dict[str, torch.Tensor],
                 modules: Sequence[tuple[str, type, bool, str, Mapping[str, Any]]] = (), name: str = "model",
                 reshard: Optional[Callable[[dict[str, bool], dict[str, bool]], Programs]] = None,
                 train_override: Optional[Callable[..., Optional[tuple[dict[str, bool], dict[str, bool]]]]] = None,
                 auto: Any = None, autocast: Optional[AutocastState] = None,
                 src_data_rank: Optional[int] = 0, unfilled: Sequence[str] = (), captured: Sequence[Captured] = ()):
        super().__init__()
        self._captured = tuple(captured)  # Python scalars the model's forward code read when traced
        self._autocast = autocast  # the autocast state every program was traced in (precision.py)
        self._mesh = mesh
        self._info = info
        self._placements = placements
        self._global_shapes = global_shapes
        self._where = f"ShardedModule({name})"
        # sharding again runs collectives and traces: never inside a TorchDynamo trace (a graph break there)
        self._reshard = None if reshard is None else torch.compiler.disable(reshard)
        self._auto = auto
        self._src_data_rank = src_data_rank
        scopes: dict[str, nn.Module] = {"": self}
        for fqn, kind, training, first, traced in modules:  # pre-order, so parents come first
            if fqn == "":
                self.training = training
                _keep_traced(self, traced)
                continue
            *path, leaf = fqn.split(".")
            if first == fqn:
                scopes[fqn] = _scope(kind, fqn, traced)
                scopes[fqn].training = training
            else:  # the same submodule under a second name: one stand-in, one mode
                scopes[fqn] = scopes[first]
            scopes[".".join(path)].add_module(leaf, scopes[fqn])
        # eager's model.train() runs these classes' own train(): FQN -> the override run on the meta copy
        self._train_overrides = {} if train_override is None else {
            fqn: functools.partial(train_override, fqn)
            for fqn, kind, _, first, _ in modules if fqn == first and kind.train is not nn.Module.train}
        _register_train_overrides(self)
        self._mode_names = [fqn for fqn, _, _, first, _ in modules if fqn == first] or [""]
        self._mode_scopes = [scopes[n] for n in self._mode_names]
        self._param_names = [slot.names[0] for slot in programs.traced.slots if slot.kind == "param"]
        self._trained = [slot.requires_grad for slot in programs.traced.slots if slot.kind == "param"]
        # the local dtype and shape the programs were traced for
        self._locals = {slot.names[0]: (tensors[slot.names[0]].dtype, tensors[slot.names[0]].shape)
                        for slot in programs.traced.slots if slot.kind in ("param", "buffer")}
        homes = []
        for slot in programs.traced.slots:
            if slot.kind not in ("param", "buffer"):
                continue
            t = tensors[slot.names[0]]
            for fqn in slot.names:
                *path, leaf = fqn.split(".")
                owner = _container(self, path)
                if slot.kind == "param":
                    owner.register_parameter(leaf, t)
                else:
                    owner.register_buffer(leaf, t, persistent=slot.persistent)
                homes.append((fqn, owner, leaf))
        self._tensor_homes = tuple(homes)  # (name, module, attribute) of every parameter and buffer
        self._current = programs
        self._by_mode: dict[tuple[bool, ...], Programs] = {self._mode_key(): programs}
        self._unfilled: Optional[dict[str, tuple[int, int]]] = None
        if unfilled:
            self._unfilled = {n: (id(self._lookup(n)), self._lookup(n)._version) for n in unfilled}
        # split parameters, checked at the first call if written in place other than by fxshard's fills
        self._piece_watch: Optional[dict[str, Optional[tuple[int, int, list]]]] = None
        if communicates(self._mesh):
            self._piece_watch = {n: _written_state(p) for n, p in self.named_parameters() if self._split_axes(n)}
        self.register_state_dict_post_hook(_state_dict_as_dtensors)
        self.register_load_state_dict_pre_hook(_state_dict_from_dtensors)
        track_optimizers(self)
        track_gradients(self)

    def __setstate__(self, state: dict) -> None:
        """A copy (``copy.deepcopy(sm)``, a pickle loaded) is tracked like the original: its optimizers present
        their state as DTensors and its gradients are checked at their steps (``__init__`` does not run)."""
        super().__setstate__(state)
        _register_train_overrides(self)
        track_optimizers(self)
        track_gradients(self)

    # ---- the programs of the current modes ---------------------------------------------------
    @property
    def _traced(self) -> Traced:
        return self._current.traced

    @property
    def _fwd(self) -> Program:
        return self._current.forward

    @property
    def _training(self) -> Optional[Training]:
        return self._current.training

    @property
    def _slots(self) -> list:
        return self._current.traced.slots

    def _mode_key(self) -> tuple[bool, ...]:
        """Each submodule's ``training``, then per parameter whether a program must train it: it requires grad
        now or did at ``shard()`` (a parameter frozen since needs no other program: autograd drops its gradient)."""
        return (tuple(m.training for m in self._mode_scopes)
                + tuple(t or self._lookup(n).requires_grad for n, t in zip(self._param_names, self._trained)))

    def _for_mode(self) -> Programs:
        """The programs for the modules' current modes and trainable parameters, sharded on first use (see
        class doc)."""
        key = self._mode_key()
        progs = self._by_mode.get(key)
        if progs is None:
            if self._reshard is None:  # modes fixed by the caller (fxshard.backend: TorchDynamo re-captures)
                return self._current
            k = len(self._mode_names)
            with torch.enable_grad(), torch.random.fork_rng(devices=[]):  # tracing leaves the RNG as it was
                progs = self._reshard(dict(zip(self._mode_names, key[:k])), dict(zip(self._param_names, key[k:])))
            self._by_mode[key] = progs
        if progs is not self._current:  # no attribute write on the common path (torch.compile traces this)
            self._current = progs
        return progs

    @property
    def sharding(self) -> Sharding:
        """A read-only view of the plan and programs (``fxshard.runtime.description.Sharding``): what
        ``fxshard.explain``, ``comm_stats`` and ``memory`` describe."""
        cur = self._current
        return Sharding(self._info, tuple(self._programs()), cur.forward, cur.training,
                        MappingProxyType(dict(self._placements)), MappingProxyType(dict(self._global_shapes)),
                        tuple(cur.traced.slots), is_module=True, auto=self._auto)

    def _programs(self) -> list[Program]:
        """Training forward/backward when the module trains, else the inference forward: those of the
        current modes when they were sharded already, else those that ran last."""
        progs = self._by_mode.get(self._mode_key(), self._current)
        if progs.training is not None:
            return [progs.training.fwd, progs.training.bwd]
        return [progs.forward]

    # ---- running -------------------------------------------------------------------------
    def _check_filled(self) -> None:
        """Raise if a parameter/buffer created on meta was never written (see ``_unfilled``)."""
        if self._unfilled is None:
            return
        empty = [n for n, (ident, version) in self._unfilled.items()
                 if id(t := self._lookup(n)) == ident and t._version == version and holds_sentinel(t)]
        if empty:
            raise ShardingError(
                f"{self._where} was called before {len(empty)} of its {len(self._unfilled)} parameters/buffers "
                f"were filled: {name_few(empty, 8)} came from a model built on the meta device and were "
                f"never initialized or loaded, so they hold no values. Fill them first: sm.init_parameters(fn), "
                f"sm.load_full_state_dict(path_or_state_dict), dcp.load(sm.sharded_state_dict(), ...), or "
                f"in-place writes to sm's tensors (with torch.no_grad(): p.copy_(...), nn.init.*_(p))"
            )
        self._unfilled = None

    def _check_pieces(self) -> None:
        """Raise if every rank of a mesh axis wrote a split parameter's piece in place with the same values
        (not one constant) since ``shard()``, other than through fxshard's fills (see ``_piece_watch``):
        ``nn.init.*_(p)`` on the pieces with one seed everywhere. Once: a collective at the first call."""
        watch, self._piece_watch = self._piece_watch, None
        written = {}
        for n, before in watch.items():  # the same names on every rank: what each wrote may differ
            t = self._lookup(n)
            now = _written_state(t)
            if before is not None and now is not None and now[0] == before[0] and now != before \
                    and not _one_value(t):
                written[n] = t
        check_pieces_differ(
            written, {n: self._split_axes(n) for n in watch}, self._mesh,
            f"{self._where} was called after split parameters were written in place on every rank alike",
            "each rank holds only its piece of a split parameter, so the full tensor now repeats one piece instead "
            "of holding what the unsharded model's init gives (nn.init.*_(p) on sm.parameters() draws the same "
            "numbers on every rank seeded alike, and takes fan-in from the piece's shape). Initialize with "
            "sm.init_parameters(fn) (fn(name, t) sees each tensor at its global shape), load full values with "
            "sm.load_full_state_dict(...), or initialize the model before shard(); pieces meant to be equal "
            "(experts copied from one layer, kv heads repeated for the split) are written by "
            "sm.load_full_state_dict(...) or sm.init_parameters(fn, exact=True)")

    def _split_axes(self, fqn: str) -> list[int]:
        """The mesh axes of several ranks that parameter or buffer ``fqn`` is split over."""
        return [a for a, pl in enumerate(self._placements[fqn]) if isinstance(pl, S) and self._info.sizes[a] > 1]

    def _mark_filled(self, names: Any) -> None:
        """Note that fxshard wrote ``names`` (fills and loads): they are no longer unfilled, nor checked by
        ``_check_pieces``."""
        if self._unfilled is not None:
            for n in names:
                self._unfilled.pop(n, None)
        if self._piece_watch is not None:
            for n in names:
                if n in self._piece_watch:  # kept (every rank checks the same names), as written now
                    self._piece_watch[n] = _written_state(self._lookup(n))

    def _call_error(self, progs: Programs, args: tuple, kwargs: dict) -> ShardingError:
        """Why ``(args, kwargs)`` does not have the structure the module was sharded for."""
        want_args, want_kw = progs.traced.in_tree.children()
        n_want, kw_want = want_args.num_children, list(want_kw.context)
        if len(args) != n_want or sorted(kwargs) != sorted(kw_want):
            return ShardingError(
                f"{self._where} was called with {len(args)} positional argument(s) and keyword arguments "
                f"{sorted(kwargs)}, but it was sharded for {n_want} positional argument(s) and keyword arguments "
                f"{sorted(kw_want)} (example_inputs/example_kwargs); call it with the arguments forward was "
                f"sharded with (shard again with other example inputs to change them: {SHARED})"
            )
        pairs = [(f"positional argument {i}", a, want_args.child(i)) for i, a in enumerate(args)]
        pairs += [(f"keyword argument {k!r}", kwargs[k], want_kw.child(j)) for j, k in enumerate(kw_want)]
        for what, value, spec in pairs:
            got = pytree.tree_structure(value)
            if got != spec:
                return ShardingError(f"{self._where}: {what} is {_describe(got)}, but the example was "
                                     f"{_describe(spec)}; pass a value of the example's structure")
        return ShardingError(f"{self._where}: the arguments do not have the structure of the example inputs; "
                             f"call it like example_inputs/example_kwargs")

    def _feed(self, progs: Programs, args: tuple, kwargs: dict) -> list[Any]:
        traced = progs.traced
        kw_want = list(traced.in_tree.child(1).context)
        if set(kwargs) == set(kw_want):
            kwargs = {k: kwargs[k] for k in kw_want}  # keyword order does not matter
        flat, tree = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if tree != traced.in_tree:
            raise self._call_error(progs, args, kwargs)
        for pos in traced.tensor_leaf_positions:
            if not isinstance(flat[pos], torch.Tensor):
                raise ShardingError(f"{self._where}: {_arg_name(args, kwargs, pos)} is a {type(flat[pos]).__name__}, "
                                    f"but the example was a tensor; pass a tensor there")
        for pos, example in traced.constant_leaves.items():
            if not _same_constant(flat[pos], example):
                raise ShardingError(
                    f"{self._where}: {_arg_name(args, kwargs, pos)} is {_short(flat[pos])}, but the module was sharded "
                    f"with {example!r} there and the traced program computes with that value (torch.export "
                    f"specializes non-tensor arguments); pass {example!r}, pass the value as a tensor, or shard "
                    f"again with this value in example_inputs ({SHARED})")
        leaves = [flat[i] for i in traced.tensor_leaf_positions]
        progs.input_check.check([leaves[s.index] for s in traced.slots if s.kind == "input"], self._mesh)
        feed: list[Any] = []
        for slot in traced.slots:
            if slot.kind in ("param", "buffer"):
                t = self._lookup(slot.names[0])
                if (t.dtype, t.shape) != self._locals[slot.names[0]]:
                    raise self._local_error(slot.names[0], t)
                feed.append(t)
            elif slot.kind == "constant":
                feed.append(traced.constants[slot.names[0]])
            else:
                feed.append(leaves[slot.index])
        return feed

    def _how_split(self, fqn: str) -> str:
        """How parameter or buffer ``fqn`` is split over the mesh, e.g. ``"S(0) over 'tp'"``; empty if it is
        whole on every rank."""
        return ", ".join(f"{pl!r} over {axis!r}" for pl, axis in zip(self._placements[fqn], self._info.names)
                         if pl != R)

    def _local_error(self, fqn: str, t: torch.Tensor) -> ShardingError:
        want, shape = self._locals[fqn]
        if t.shape != shape:
            how = self._how_split(fqn)
            part = (f"this rank's part of it, of shape {list(shape)} (global {list(self._global_shapes[fqn])}, split "
                    f"{how})" if how else f"shape {list(shape)} (whole on every rank)")
            return ShardingError(
                f"{self._where}: {fqn} has shape {list(t.shape)} on this rank, but the programs were traced for "
                f"{part}; load a full value with sm.load_state_dict({{{fqn!r}: full_tensor}}, strict=False) (it "
                f"keeps this rank's part), or assign a tensor of the local shape")
        dtype = t.dtype
        return ShardingError(
            f"{self._where}: {fqn} has dtype {dtype}, but the module was sharded with it in {want} and the "
            f"programs were traced for that (e.g. after sm.to({dtype}) or sm.half()); convert the model before "
            f"shard() (model.to({dtype})), or convert this module back (sm.to({want}))")

    def _lookup(self, fqn: str) -> torch.Tensor:
        m: Any = self
        for part in fqn.split("."):
            m = getattr(m, part)
        return m

    def _fsdp_scopes(self) -> list[nn.Module]:
        """Submodules ``fully_shard`` was applied to (FSDP2 per layer), in pre-order."""
        return [m for m in self.modules() if m is not self and _is_fsdp(m, "_fully_shard", "FSDPModule")]

    def _reshard_fsdp(self) -> None:
        """Under FSDP2: frees the parameters FSDP2 gathered (its root keeps them gathered after a forward
        until a backward reshards them), so that ``self.parameters()`` are FSDP2's sharded parameters again:
        the ones the optimizer updates and the backward accumulates gradients into. A forward never
        backpropagated otherwise left them gathered, and then ``zero_grad()`` cleared the gathered copies'
        gradients instead of the sharded ones (the next backward accumulated onto the old gradients) and a
        forward after an optimizer step computed with the gathered copies' old values. A no-op without
        FSDP2 or when nothing is gathered."""
        for m in [self, *self._fsdp_scopes()]:
            if _is_fsdp(m, "_fully_shard", "FSDPModule"):
                m.reshard()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``; under FSDP2 it first frees FSDP2's gathered parameters (see
        ``_reshard_fsdp``), so it clears the gradients of the parameters the next backward accumulates into."""
        self._reshard_fsdp()
        super().zero_grad(set_to_none)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Local outputs for local inputs; differentiable when grad mode is on (see class doc).

        Submodules under FSDP2 (``fully_shard(sm.layers[i])``) are never called themselves, so their FSDP2
        hooks run around the one program: every such submodule's pre-forward hook (all-gathers its
        parameters) before it, its post-forward hook (reshards them, and registers the all-gather
        before the backward on the outputs) after it, with no inputs and the program's outputs. Under
        FSDP2 each call first frees whatever an earlier forward left gathered (``_reshard_fsdp``), so a
        forward computes with the sharded parameters' current values."""
        check_autocast(f"{self._where} was called", self._mesh.device_type, self.__dict__.get("_autocast"))
        # under TorchDynamo the stack is a traced value, never None: a transform around a compiled module is not seen
        if not torch.compiler.is_compiling() and peek_interpreter_stack() is not None:
            raise ShardingError(
                f"{self._where} was called under a torch.func transform (grad, vmap, jacrev, ...): it runs its "
                f"sharded programs as one autograd step that such transforms cannot see into, so they would fail "
                f"or compute something else. Shard the whole computation with fxshard.jit (torch.func inside the "
                f"function, as for a gradient penalty), or apply the transform to the unsharded model")
        if not torch.compiler.is_compiling() and _forward_ad._current_level >= 0:  # inside fwAD.dual_level()
            _refuse_dual_tensors(self, args, kwargs)
        if not torch.compiler.is_compiling():
            _refuse_parametrized_since(self)
        check_captured(self._captured, f"{self._where}: the forward", fix=_MODULE_FIX)
        forward_started(self)
        progs = self._for_mode()
        self._check_filled()
        if self._piece_watch is not None and not torch.compiler.is_compiling():
            self._check_pieces()
        fsdp = self._fsdp_scopes()
        if (fsdp or _is_fsdp(self, "_fully_shard", "FSDPModule")) and "_fsdp_hooks" not in self.__dict__:
            # the pre-hook before FSDP2's own pre-forward hook, the hook after its post-forward hook
            self.__dict__["_fsdp_hooks"] = (
                self.register_forward_pre_hook(_reshard_before_forward, prepend=True),
                self.register_forward_hook(_reshard_after_inference))
        for m in fsdp:
            for hid, hook in list(m._forward_pre_hooks.items()):
                hook(m, (), {}) if m._forward_pre_hooks_with_kwargs.get(hid) else hook(m, ())
        with autocast_off(self._mesh.device_type):  # the programs hold autocast's casts (precision.py)
            outs = self._run(progs, args, kwargs)
        for m in fsdp:
            for hid, hook in list(m._forward_hooks.items()):
                hook(m, (), {}, outs) if m._forward_hooks_with_kwargs.get(hid) else hook(m, (), outs)
        return pytree.tree_unflatten(list(outs[len(progs.traced.mutations):]), progs.traced.out_tree)

    def compile(self, **kwargs: Any) -> None:
        """``nn.Module.compile`` (``torch.compile`` of this module, in place) that keeps the programs'
        overlap schedule under inductor.

        Requires ``torch.compile``'s keyword arguments; unlike ``torch.compile``, ``mode`` and ``options``
        may both be given. Ensures: when the backend is inductor (``backend`` given as ``"inductor"``, or
        left out or ``None`` with inductor as dynamo's default backend), the options inductor gets are
        those of ``mode`` (inductor's ``list_mode_options``), then ``fxshard.frontends.backend.INDUCTOR_OPTIONS``,
        then the caller's ``options`` (which win); other backends get the arguments unchanged.
        (``torch.compile(sm)`` itself cannot be intercepted: pass
        ``options=dict(fxshard.frontends.backend.INDUCTOR_OPTIONS)`` there.)"""
        from ..passes.overlap import INDUCTOR_OPTIONS

        backend = kwargs.get("backend")
        if backend is None:
            from ..core.torch_compat import get_default_backend

            backend = get_default_backend()
        if backend == "inductor":
            mode = kwargs.pop("mode", None)  # torch.compile takes a mode or options, not both
            by_mode = {}
            if mode is not None:
                from ..core.torch_compat import list_mode_options

                by_mode = list_mode_options(mode, kwargs.get("dynamic"))
            kwargs["options"] = {**by_mode, **INDUCTOR_OPTIONS, **(kwargs.get("options") or {})}
        super().compile(**kwargs)

    def _run(self, progs: Programs, args: tuple, kwargs: dict) -> tuple:
        """The program's flat outputs (buffer updates first, written back here)."""
        feed = self._feed(progs, args, kwargs)
        tr, un = progs.training, progs.untrainable
        if torch.is_grad_enabled():
            wanted = tr.diff_in if tr is not None else un.diff_in if un is not None else ()
            for i, (slot, x) in enumerate(zip(progs.traced.slots, feed)):
                if (slot.kind == "input" and isinstance(x, torch.Tensor) and x.requires_grad
                        and i not in wanted):
                    raise ShardingError(
                        f"input {slot.index} requires grad but the example input did not, so {self._where} has no "
                        f"program for its gradient; pass an example input with requires_grad=True to shard() to get "
                        f"its gradient, or call with a tensor that does not require grad (x.detach())"
                    )
        if tr is not None and torch.is_grad_enabled() and any(
            isinstance(feed[i], torch.Tensor) and feed[i].requires_grad for i in tr.diff_in
        ):
            views: list[_Views] = []
            outs = list(_RunSharded.apply(tr, self._where, views, *feed))  # it writes the buffers
            for group in views:  # outputs that view one tensor, as views of it (see _Views)
                root = outs[group.slot]
                for i, size, stride, offset in group.members:
                    outs[i] = root if i == group.slot else root.as_strided(size, stride, offset)
            return tuple(outs[: tr.n_out])
        mutations = progs.traced.mutations
        if un is not None and torch.is_grad_enabled() and any(
            isinstance(feed[i], torch.Tensor) and feed[i].requires_grad for i in un.diff_in
        ):
            outs = _NoGradient.apply(un, progs.forward.gm, self._where, len(mutations), *feed)
        else:
            outs = run_program(progs.forward.gm, feed, f"the forward of {self._where}")
        if mutations:
            _write_buffers([self._lookup(name) for name in mutations], outs)
        return tuple(outs)

    # ---- state ---------------------------------------------------------------------------
    def _state_tensors(self) -> dict[str, torch.Tensor]:
        """Every ``state_dict`` entry (tied names and persistent buffers) as the tensor registered now:
        a local shard, or FSDP2's DTensor of it after ``fully_shard``."""
        out = {}
        for prefix, m in self.named_modules(remove_duplicate=False):
            pre = prefix + "." if prefix else ""
            out.update({pre + n: p for n, p in m._parameters.items() if p is not None})
            out.update({pre + n: b for n, b in m._buffers.items()
                        if b is not None and n not in m._non_persistent_buffers_set})
        return out

    def _dtensor(self, fqn: str, local: torch.Tensor) -> DTensor:
        """``local`` (a shard of ``fqn``, or FSDP2's DTensor of it) as a DTensor of the global tensor."""
        return global_view(local, self._mesh, self._placements[fqn], self._global_shapes[fqn], fqn)

    def _own_piece(self, fqn: str, own: torch.Tensor, value: Any, name: str) -> torch.Tensor:
        """The part of ``value`` (a DTensor of ``fqn``'s global tensor in any layout, or the full tensor) this
        rank holds, in the type of ``own`` (the registered tensor: a local shard, or FSDP2's DTensor of it)."""
        piece = local_piece(value, self._dtensor(fqn, own.detach()), self._pieces(fqn, own), name)
        if isinstance(own, DTensor):
            piece = DTensor.from_local(piece, own.device_mesh, own.placements, shape=own.shape, stride=own.stride(),
                                       run_check=False)
        return piece

    def _pieces(self, fqn: str, local: torch.Tensor) -> list[Piece]:
        return held_pieces(local, tuple(int(s) for s in self._global_shapes[fqn]), self._placements[fqn], self._info)

    def _named_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer (non-persistent ones too), once per tensor."""
        return {**dict(self.named_parameters()), **dict(self.named_buffers())}

    def apply(self, fn: Callable[[nn.Module], None]) -> "ShardedModule":
        """``nn.Module.apply``. Stand-ins are instances of their original classes, so an initializer selecting
        modules by type (``if isinstance(m, nn.Linear): nn.init.normal_(m.weight)``) runs on this rank's pieces:
        on a split parameter it sees the piece's shape (its fan-in) and draws the same numbers on every rank, so
        the full tensor is not what the unsharded model's init gives. Ensures: a split parameter ``fn`` wrote in
        place with anything but one constant (``zeros_``, ``ones_``, ``constant_`` are right on pieces) is a
        ShardingError naming it and ``init_parameters``."""
        watched = [(fqn, p, p._version) for fqn, p in self.named_parameters() if self._how_split(fqn)]
        super().apply(fn)
        changed = [fqn for fqn, p, version in watched if p._version != version and not _one_value(p)]
        if changed:
            raise ShardingError(
                f"{self._where}.apply(fn) wrote {name_few(changed, 3)} in place with values that are not one "
                f"constant, but each rank holds only its piece of these split parameters ({self._how_split(changed[0])}"
                f" for the first): an nn.init function run on a piece sees the piece's shape (its fan-in) and draws "
                f"the same numbers on every rank, so they now hold other values than the unsharded model's init "
                f"gives. Initialize them with sm.init_parameters(fn) (fn(name, t) sees each tensor at its global "
                f"shape), or initialize the model before shard()")
        return self

    def init_parameters(self, init: Callable[[str, torch.Tensor], Any], *, exact: bool = False,
                        seed: Optional[int] = None) -> None:
        """Fill every parameter and buffer (non-persistent buffers too) by ``init(fqn, t)``, which writes ``t``
        (global shape) in place, e.g. ``nn.init.normal_(t, std=0.02)``.

        Default (tiled): no full tensor is built. ``init`` runs on each fixed tile of the global tensor that
        this rank holds (``t`` reports the global shape, so fan-in based inits are right; random ops draw from
        a generator per ``(seed, fqn, tile)``; see ``fxshard.state.tiled_init``), so peak memory is the shard plus one
        tile and the values do not depend on the mesh: ``fxshard.tiled_init(model, init, seed=seed)`` gives the
        same values in the unsharded model. ``seed`` defaults to a draw from torch's generator on rank
        ``src_data_rank``. Only elementwise/random ops on ``t`` are supported; others raise a ShardingError.
        Tensors ``init`` does not write keep their values (a meta-built one stays unfilled).

        ``exact=True``: ``init`` writes the full (CPU) tensor, one tensor at a time, and this rank keeps its
        slice: any ``init`` works and a per-tensor seeded one reproduces the unsharded init bit for bit. Values
        come from rank ``src_data_rank`` (default 0), whose full tensor is broadcast (with
        ``src_data_rank=None`` each rank keeps its own, and replicated values that differ raise a ShardingError).
        A tensor ``init`` does not write in place keeps its values here too; one it writes must be written whole.
        """
        src = self._src_data_rank if communicates(self._mesh) else None
        own = self._named_tensors()
        filled = []
        with torch.no_grad():
            if not exact:
                seed = draw_seed(seed)
                if src is not None:
                    seed = int(from_source(torch.tensor([seed]), src, self._mesh, torch.device("cpu"))[0])
            for name, local in own.items():
                shape = tuple(int(s) for s in self._global_shapes[name])
                if not exact:
                    if fill_tiles(storage(local), name, shape, init, self._pieces(name, local), seed):
                        filled.append(name)
                    continue
                full = torch.empty(shape, dtype=local.dtype, device="cpu")
                version = full._version
                init(name, full)
                if full._version == version:  # init left it alone: it keeps its values (or stays unfilled)
                    continue
                if src is not None:
                    full = from_source(full, src, self._mesh, local.device, writable=True)
                self._write(name, local, lambda src_box: full[src_box])
                filled.append(name)
                del full
        self._mark_filled(filled)
        if self._src_data_rank is None:
            check_replicas(own, self._placements, self._mesh,
                           "init_parameters(fn) with src_data_rank=None keeps each rank's values: pass a seed, or "
                           "seed fn per tensor with exact=True, or shard with src_data_rank=0 to take rank 0's values")

    def _write(self, fqn: str, local: torch.Tensor, read: Callable[[tuple[slice, ...]], torch.Tensor]) -> None:
        """Fill what ``local`` holds of ``fqn`` from ``read(box of the global tensor)``."""
        pieces = self._pieces(fqn, local)
        if pieces:
            storage(local).copy_(assemble(pieces, read))

    def sharded_state_dict(self) -> dict[str, DTensor]:
        """``sm.state_dict()``: every entry a DTensor of the global tensor (no communication).

        This is what ``torch.distributed.checkpoint`` (DCP) saves and loads: its metadata
        records the global shapes and placements, so a checkpoint saved at one mesh loads at
        another mesh, or into the unsharded model. After FSDP2's ``fully_shard(sm, mesh=mesh["dp"])``
        the DTensors live on the ``(dp, tp)`` mesh and still describe the global tensors.
        """
        return {name: self._dtensor(name, t.detach()) for name, t in self._state_tensors().items()}

    def load_sharded_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Copy DTensors (e.g. filled in place by ``dcp.load``) into the local shards; a DTensor laid out
        otherwise is gathered first, and a plain tensor must be this rank's local piece."""
        own = self._state_tensors()
        missing = [k for k in own if k not in state_dict]
        if missing:
            raise ShardingError(f"load_sharded_state_dict: missing keys {missing[:5]}; pass sm.sharded_state_dict() "
                                f"after loading into it")
        with torch.no_grad():
            for name, local in own.items():
                v = state_dict[name]
                if isinstance(v, DTensor):
                    v = local_piece(v, self._dtensor(name, local.detach()), self._pieces(name, local), name)
                if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(storage(local).shape):
                    got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                    raise ShardingError(
                        f"load_sharded_state_dict: {name} is {got} on this rank, but its local shard is "
                        f"{tuple(storage(local).shape)}; pass sm.sharded_state_dict() after loading into it "
                        f"(dcp.load), or use load_full_state_dict for full tensors"
                    )
                storage(local).copy_(v)
        self._mark_filled(own)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this module's parameters, as on the unsharded model (a
        collective: call on all ranks). Use it instead of torch's, which sees only this rank's pieces of split
        gradients and would clip each rank by its own norm.

        Requires: gradients from a backward of this module (parameters without one are skipped).
        Ensures: returns the total norm of the full gradients (``norm_type``: p of the p-norm, ``inf`` for the
        max norm), the same on every rank, and scales every local gradient in place by
        ``min(1, max_norm / (norm + 1e-6))``; with ``error_if_nonfinite`` a non-finite norm raises RuntimeError
        first, as torch's does."""
        self._reshard_fsdp()  # the gradients are the sharded parameters' (a forward may have gathered them)
        total = _clip_grad_norm(self, max_norm, norm_type, error_if_nonfinite)
        record_gradients(self, if_recorded=True)  # scaled as eager scales them: not a change grad_guard warns about
        return total

    def full_state_dict(self, *, rank0_only: bool = False, cpu_offload: bool = False) -> dict[str, torch.Tensor]:
        """Full tensors under exactly the original ``model.state_dict()`` keys (a collective: call on all ranks).

        Tensors are gathered one at a time; with ``cpu_offload`` each is moved to CPU right away,
        and with ``rank0_only`` other ranks drop it (they return ``{}``), so exporting a model to
        one file needs at most one full tensor of device memory on any rank. Works after FSDP2's
        ``fully_shard`` too (gathered over both meshes).
        """
        keep = not rank0_only or torch.distributed.get_rank() == 0
        out = {}
        for name, local in self._state_tensors().items():
            full = self._dtensor(name, local.detach()).full_tensor()
            if keep:
                out[name] = full.cpu() if cpu_offload else full
            del full
        return out

    def load_full_state_dict(self, src: Any) -> None:
        """Copy each rank's slices of a full checkpoint into the local shards.

        ``src`` is a state dict (keys as in ``model.state_dict()``), a ``.safetensors`` file, or a
        directory of HF-style sharded safetensors files; from files each rank reads only its slices. A key
        the module lacks is a ShardingError; entries the module has no place for are skipped with a warning.
        """
        reader = open_checkpoint(src)
        own = self._state_tensors()
        have = set(reader.keys())
        missing = [k for k in own if k not in have]
        if missing:
            raise ShardingError(
                f"load_full_state_dict: missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}; pass a "
                f"checkpoint of the full model (keys as in model.state_dict())"
            )
        unused = sorted(have - set(own))
        if unused:  # as HF's loader: real checkpoints carry extras (a tied head, old rotary buffers)
            warnings.warn(
                f"load_full_state_dict: {len(unused)} checkpoint entries match no parameter or persistent buffer of "
                f"{self._where} and were not loaded: {unused[:5]}{' ...' if len(unused) > 5 else ''}; check that "
                f"the checkpoint is this model's", stacklevel=2)
        with torch.no_grad():
            for name, local in own.items():
                pieces = self._pieces(name, local)
                if pieces:
                    shape = tuple(int(s) for s in self._global_shapes[name])
                    storage(local).copy_(reader.read(name, pieces, shape))
        self._mark_filled(own)


def _refuse_dual_tensors(sm: ShardedModule, args: tuple, kwargs: dict) -> None:
    """Raise if a call argument, parameter or buffer of ``sm`` carries a forward-mode AD tangent
    (``torch.autograd.forward_ad.make_dual``). Requires an open dual level (``fwAD.dual_level()``)."""
    tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    tensors += [*sm.parameters(), *sm.buffers()]
    if any(_forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        raise ShardingError(
            f"{sm._where} was called with a forward-mode AD tangent (torch.autograd.forward_ad.make_dual): "
            f"forward-mode AD through a ShardedModule is not supported, as each rank's program would carry "
            f"only its part of the tangent through the collectives and return a wrong one. Shard the whole "
            f"computation with fxshard.jit of a function that calls torch.func.jvp (torch.func.functional_call "
            f"of the model inside), or take the JVP of the unsharded model")


def _refuse_parametrized_since(sm: ShardedModule) -> None:
    """Raise if a parameter or buffer of ``sm`` was made parametrized (``torch.nn.utils.parametrize``) on its
    stand-in after ``shard()``: it is no longer registered where ``shard()`` put it."""
    for fqn, owner, leaf in sm._tensor_homes:
        if leaf not in owner._parameters and leaf not in owner._buffers and is_parametrized(owner, leaf):
            how = sm._how_split(fqn)
            raise ShardingError(
                f"{sm._where}: {fqn} was parametrized after shard() (torch.nn.utils.parametrize: weight_norm, "
                f"spectral_norm, orthogonal, ...). On the ShardedModule the parametrization computes from this rank's "
                f"tensors{f' ({fqn} is split {how})' if how else ''}, so a norm or a spectral norm would be that of "
                f"a piece, not of the full tensor, and the model would compute something else than the unsharded "
                f"one. Register the parametrization on the model before shard() (a parametrized weight is sharded by "
                f"its computed value and trains as in eager)")


def _state_dict_as_dtensors(sm: ShardedModule, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """``sm.state_dict()`` post-hook: every entry of ``sm`` becomes the DTensor of its global tensor, so
    ``dcp.save(sm.state_dict())`` and torch's ``get_model_state_dict`` (full or sharded) see global shapes."""
    for fqn, t in sm._state_tensors().items():
        if prefix + fqn in state_dict:
            state_dict[prefix + fqn] = sm._dtensor(fqn, state_dict[prefix + fqn])


def _reshard_before_forward(sm: ShardedModule, args: Any) -> None:
    """A forward pre-hook (under FSDP2, before FSDP2's own): ``sm._reshard_fsdp()``, so FSDP2's pre-forward
    gathers the sharded parameters' current values instead of reusing copies an earlier forward left."""
    sm._reshard_fsdp()


def _reshard_after_inference(sm: ShardedModule, args: Any, outs: Any) -> None:
    """A forward hook (under FSDP2) that frees FSDP2's gathered parameters after a forward without
    gradients: no backward follows to free them, and they would hold a full copy of every parameter the
    root group owns until the next forward."""
    if not torch.is_grad_enabled():
        sm._reshard_fsdp()


def _is_fsdp(x: Any, module: str, cls: str) -> bool:
    """``isinstance(x, torch.distributed.fsdp._fully_shard.<module>.<cls>)`` without importing FSDP (a fifth
    of fxshard's import time): nothing can be an instance before that module is imported."""
    mod = sys.modules.get(f"torch.distributed.fsdp._fully_shard.{module}")
    return mod is not None and isinstance(x, getattr(mod, cls))


def _state_dict_from_dtensors(sm: ShardedModule, state_dict: dict, prefix: str, *rest: Any) -> None:
    """``sm.load_state_dict()`` pre-hook: each entry given as a DTensor (any layout) or a full tensor becomes
    this rank's piece, in the type of the registered tensor (FSDP2's DTensor after ``fully_shard``)."""
    sm._reshard_fsdp()  # under FSDP2, the registered parameters are its sharded DTensors from here on
    loaded = []
    for fqn, own in sm._state_tensors().items():
        key = prefix + fqn
        if key not in state_dict:
            continue
        state_dict[key] = sm._own_piece(fqn, own, state_dict[key], key)
        loaded.append(fqn)
    sm._mark_filled(loaded)


def local_slice(full: torch.Tensor, mesh: DeviceMesh, pls: tuple[Pl, ...]) -> torch.Tensor:
    """This rank's piece of a full tensor laid out per ``pls`` (no communication; a view unless packed)."""
    return take(full, pls, MeshInfo.of(mesh))
