"""A gradient scaler's step over a ShardedModule's split parameters.

``torch.amp.GradScaler.step`` skips ``optimizer.step()`` when a gradient holds an inf or NaN, and it looks at
this rank's gradients only. A rank holds its pieces of split gradients, so an overflow in one rank's piece makes
that rank skip the step while the others take it: the model trains differently from the unsharded one, the
replicas of replicated parameters drift apart and the ranks' loss scales differ, with no error. A collective that
a stepping rank runs at the step (fxshard's gradient check) waits for the rank that skipped until the timeout.
``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` all-reduces the overflow flags over its process
group (the world by default), so that every rank steps or skips together, as eager does.

The ranks that step can see the scaler (it is the caller of ``optimizer.step()``); the rank that skips never
calls ``optimizer.step()``. :func:`check_scaler` therefore runs in the optimizer step pre-hook before anything
else that communicates, and raises on every rank that steps unless the scaler combines the flags over the ranks
that hold the split parameters' pieces.
"""

from __future__ import annotations

import sys
from typing import Any, Collection, Optional

import torch
import torch.distributed as dist
from torch.amp import GradScaler
from torch.amp.grad_scaler import OptState

from ..core.errors import ShardingError, name_few

__all__ = ["calling_scaler", "check_scaler"]

_STEPPING = frozenset({"step", "_maybe_opt_step"})  # GradScaler's methods that call optimizer.step()
_DEPTH = 12  # frames above the step pre-hook searched for the scaler (optimizer.step's and LR schedulers' wrappers)


def calling_scaler() -> Optional[GradScaler]:
    """The ``torch.amp.GradScaler`` (or subclass) whose method is running in one of the frames calling this
    function's caller (e.g. ``scaler.step(opt)`` calling ``opt.step()``), or None."""
    frame = sys._getframe(2)
    for _ in range(_DEPTH):
        if frame is None:
            return None
        # only the scaler's methods that call optimizer.step(): reading f_locals copies a frame's locals, and this
        # runs at every step (a training loop's or a trainer's frames hold many)
        code = frame.f_code
        if code.co_name in _STEPPING and code.co_varnames[:1] == ("self",) \
                and isinstance(owner := frame.f_locals.get("self"), GradScaler):
            return owner
        frame = frame.f_back
    return None


def check_scaler(scaler: GradScaler, optimizer: torch.optim.Optimizer, split: dict[str, str],
                 ranks: Collection[int], device: str) -> None:
    """Requires: ``scaler`` is calling ``optimizer.step()``; ``split`` maps each parameter ``optimizer`` holds
    that a ShardedModule split to how (non-empty), ``ranks`` are the ranks holding their pieces, ``device`` the
    mesh's device type. Ensures: returns when every rank steps or skips as eager would (a disabled scaler, or a
    ShardedGradScaler whose process group holds ``ranks``), else raises ShardingError before any collective.
    For a fused optimizer that ``scaler`` has not unscaled (it then reads ``optimizer.found_inf``, which
    ShardedGradScaler does not combine), combines the flags over the scaler's group (a collective)."""
    if not scaler.is_enabled():
        return
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # imports FSDP: only when needed

    names = name_few([f"{fqn} ({how})" for fqn, how in split.items()], 3)
    fix = (f"use torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler({device!r}, ...) in place of "
           f"torch.amp.GradScaler (same arguments; its process group, the world by default, must hold every rank "
           f"of the mesh axes that split parameters): it combines the overflow flags over the ranks, so every rank "
           f"steps or skips together")
    if not isinstance(scaler, ShardedGradScaler):
        raise ShardingError(
            f"{type(scaler).__name__}.step is stepping {type(optimizer).__name__}, which holds split parameters: "
            f"{names}. The scaler decides from this rank's gradients alone whether the step overflowed, and "
            f"this rank holds only its pieces of split gradients: an inf/NaN in one rank's piece makes that rank "
            f"skip the step while the others take it, so the model trains differently from the unsharded one "
            f"and replicated parameters drift apart between ranks (a rank that skipped waits in its next "
            f"collective); {fix}")
    group = scaler.process_group if scaler.process_group is not None else dist.group.WORLD
    held = set(dist.get_process_group_ranks(group))
    if not set(ranks) <= held:
        raise ShardingError(
            f"ShardedGradScaler.step is stepping {type(optimizer).__name__}, which holds split parameters: "
            f"{names}, whose pieces are on ranks {sorted(ranks)}, but the scaler's process group holds ranks "
            f"{sorted(held)}: ranks outside it decide alone whether the step overflowed and may step while the "
            f"others skip; give the scaler a process group holding ranks {sorted(ranks)} (the default, the world, "
            f"does)")
    _combine_fused_flags(scaler, optimizer, group)


def _combine_fused_flags(scaler: GradScaler, optimizer: torch.optim.Optimizer, group: Any) -> None:
    """A fused optimizer's step (``_step_supports_amp_scaling``) reads ``optimizer.found_inf``, which GradScaler
    computed from this rank's gradients only when the user did not call ``scaler.unscale_(optimizer)`` (the flags
    ShardedGradScaler combines are those of its ``unscale_``): combines them, and the flags ``update()`` reads."""
    state = scaler._per_optimizer_states[id(optimizer)]
    found = getattr(optimizer, "found_inf", None)
    if state["stage"] is not OptState.READY or not isinstance(found, torch.Tensor):
        return
    flags = list(state["found_inf_per_device"].values())
    for flag in flags:  # 0 or 1 on each rank: MAX keeps them so (a fused step skips on exactly 1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    with torch.no_grad():
        found.copy_(sum(flag.to(found.device) for flag in flags))
