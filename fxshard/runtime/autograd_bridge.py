"""The autograd bridge: a ShardedModule's training call as one ``torch.autograd.Function`` (``_RunSharded``)
whose forward runs the sharded forward program and whose backward runs the sharded backward program, with
outputs that view one tensor rebuilt as views of it (``_Views``) as eager's are; and the call of a module
without a training program whose backward raises why (``_NoGradient``).

``run_training`` and ``run_untrainable`` are what ``ShardedModule`` calls; ``write_buffers`` copies a
program's buffer updates (BatchNorm's running statistics) into the registered buffers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from ..comm.failures import run_program
from ..core.errors import ShardingError
from ..core.precision import autocast_off
from ..core.torch_compat import dynamo_safe_function_outputs
from .programs import Training, Untrainable

__all__ = ["run_training", "run_untrainable", "write_buffers"]


def run_training(training: Training, where: str, feed: Sequence[Any]) -> tuple:
    """The ``training.n_out`` outputs of the sharded forward program on ``feed`` (the program's inputs: primals
    in slot order), differentiable through the sharded backward program (``where`` names the module in errors).

    Requires: grad mode on and some ``feed[i]``, ``i`` in ``training.diff_in``, requiring grad. Ensures: the
    buffers the forward updates (``training.updated``) are written; outputs that view one tensor the program
    made are views of it (``_Views``), as eager's are."""
    views: list[_Views] = []
    outs = list(_RunSharded.apply(training, where, views, *feed))  # it writes the buffers
    for group in views:  # outputs that view one tensor, as views of it (see _Views)
        root = outs[group.slot]
        for i, size, stride, offset in group.members:
            outs[i] = root if i == group.slot else root.as_strided(size, stride, offset)
    return tuple(outs[: training.n_out])


def run_untrainable(untrainable: Untrainable, gm: fx.GraphModule, where: str, n_mut: int, feed: Sequence[Any]) -> tuple:
    """The outputs of the inference program ``gm`` on ``feed`` for a call that needs gradients of a module
    without a training program: its floating outputs past the ``n_mut`` buffer updates need a gradient, and
    their backward raises ``untrainable.error`` (see ``_NoGradient``)."""
    return _NoGradient.apply(untrainable, gm, where, n_mut, *feed)


@dataclass(frozen=True)
class _Views:
    """Differentiable outputs of the forward program that are views of one tensor, the root (as eager's are: an
    output and ``out.view(...)`` or ``out[:, :4]`` of it, or views of one intermediate). ``_RunSharded`` returns
    the root at ``slot`` instead (an autograd.Function's outputs that are views cannot be written in place), and
    ``run_training`` rebuilds each member ``(output index, size, stride, storage offset)`` as a view of it,
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
            write_buffers(bufs, outs)
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


def write_buffers(buffers: Sequence[torch.Tensor], outs: Sequence[Any]) -> None:
    """Copy a program's first outputs (the new values of the buffers its forward updates in place, e.g. BatchNorm
    running statistics, in ``Traced.mutations`` order) into ``buffers`` (the registered tensors, same order)."""
    with torch.no_grad():
        for buf, new in zip(buffers, outs):
            buf.copy_(new)
