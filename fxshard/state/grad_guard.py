"""Gradients changed in place between a ShardedModule's backward and the optimizer step.

A rank holds pieces of split gradients, so code written for whole gradients gives each rank its
own answer when it runs on ``sm.parameters()``. The common case is
``torch.nn.utils.clip_grad_norm_(sm.parameters(), max_norm)``: each rank computes the norm of its
own pieces and scales its gradients by its own factor. Where ranks end up with different factors,
the gradients of replicated parameters differ between ranks and the replicas drift apart from the
first step on; where none of them clips while the full gradient's norm is above ``max_norm``, every
rank skips the clipping eager would do. ``sm.clip_grad_norm_`` is the collective that clips as eager.

What is checked: the end of every backward records each gradient's tensor and version
(``track_gradients``: a post-accumulate-grad hook on each local parameter, frozen ones too since they may be
unfrozen later, queues one autograd-engine callback, which runs after every other callback of that backward,
DDP's gradient copies included).
At the next optimizer step over the module's parameters, :func:`check_gradients` compares: when some
gradient was changed in place or replaced since, and not by ``sm.clip_grad_norm_``, it warns once per
module (fxshard cannot tell what the change was), and compares the gradients of replicated parameters
across the ranks they are replicated on (a checksum each; ``replicas.check_replicas``): a difference
raises a ShardingError before the optimizer updates anything. Only mesh axes that split some parameter
are compared: along the others every rank holds the same pieces and computes the same statistics (so a
data-parallel axis costs nothing), and a module with nothing split is not checked at all. Nothing is
compared, and no collective runs, on steps whose gradients are exactly what the backward left. Sparse
gradients are left out of the comparison. Each forward re-arms the record, so a backward that failed
before its end does not switch the check off.

Requires: every rank of the mesh changes its gradients the same way (SPMD code), since the
comparison is a collective; code that changes them on some ranks only (clipping by a rank's own norm
under an ``if``) makes those ranks wait in the comparison until the process group's timeout. Not
checked: modules under FSDP2 (their gradients are FSDP2's).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Iterable, Iterator

import torch

from ..core.errors import name_few
from ..core.placements import Replicated
from ..comm.replicas import check_replicas
from ..core.torch_compat import queue_autograd_callback
from .sharded_state import HasShardedState

__all__ = ["track_gradients", "record_gradients", "check_gradients", "forward_started", "records_kept"]

_WHY = ("something changed the gradients in place after the backward, per rank (torch.nn.utils.clip_grad_norm_"
        "(sm.parameters(), ...) computes each rank's norm over only its pieces of split gradients and scales each "
        "rank by its own factor); use sm.clip_grad_norm_(max_norm), which clips by the norm of the full gradients "
        "on every rank, and compute any other per-gradient statistic over the full gradients")


def record_gradients(sm: HasShardedState, *, if_recorded: bool = False) -> None:
    """Ensures: ``sm``'s record (``sm.fxshard_state.grads``) holds each local parameter's gradient tensor and version
    as they are now (with ``if_recorded``, only when a backward's record is pending)."""
    record = sm.fxshard_state.grads
    if if_recorded and not record.grads:
        return
    record.grads = {fqn: (weakref.ref(p.grad), p.grad._version)
                    for fqn, p in sm.named_parameters() if p.grad is not None}


@contextlib.contextmanager
def records_kept(modules: Iterable[HasShardedState]) -> Iterator[None]:
    """Ensures: a step inside compares nothing for ``modules`` (gradients fxshard itself put there, as
    ``optim_state.init_optim_state``'s zeros), and each module's record is as before it afterwards."""
    records = [sm.fxshard_state.grads for sm in modules]
    kept = [record.grads for record in records]
    for record in records:
        record.grads = None
    try:
        yield
    finally:
        for record, grads in zip(records, kept):
            record.grads = grads


def forward_started(sm: HasShardedState) -> None:
    """Ensures: the next backward queues its record again, even if the last one failed before its end."""
    sm.fxshard_state.grads.queued = False


def track_gradients(sm: HasShardedState) -> None:
    """Requires: ``sm``'s local parameters are registered, and this is called once per module (at its creation or
    copy). Ensures: the end of every backward that gives one of them a gradient calls :func:`record_gradients`
    (module doc), for parameters frozen now and unfrozen later too."""
    sm.fxshard_state.grads.split = _split_axes(sm)
    ref = weakref.ref(sm)

    def after_backward(last: bool) -> None:
        mod = ref()
        if mod is None:
            return
        if not last:  # queued again: runs after the callbacks this backward queued later (DDP's)
            queue_autograd_callback(lambda: after_backward(True))
            return
        mod.fxshard_state.grads.queued = False
        record_gradients(mod)

    def accumulated(p: torch.Tensor) -> None:
        mod = ref()
        if mod is not None and not mod.fxshard_state.grads.queued:
            mod.fxshard_state.grads.queued = True
            queue_autograd_callback(lambda: after_backward(False))

    for p in sm.parameters():  # once per tensor
        if (p.is_floating_point() or p.is_complex()) and not p.is_inference():  # the tensors that can require grad
            _hook_even_if_frozen(p, accumulated)


def _hook_even_if_frozen(p: torch.Tensor, hook: Any) -> None:
    """Registers ``hook`` as ``p``'s post-accumulate-grad hook also when ``p`` is frozen now: it fires once ``p``
    is unfrozen and trained (a module sharded frozen and fine-tuned later), as a hook registered while it
    required grad keeps doing after ``requires_grad_(False)``."""
    if p.requires_grad:
        p.register_post_accumulate_grad_hook(hook)
        return
    p.requires_grad_(True)
    try:
        p.register_post_accumulate_grad_hook(hook)
    finally:
        p.requires_grad_(False)


def check_gradients(sm: HasShardedState) -> None:
    """Requires: called at an optimizer step over ``sm``'s parameters, on every rank. Ensures: when some gradient
    changed since the last backward's record (other than by ``sm.clip_grad_norm_``), a warning once per module,
    and a ShardingError if the gradients of replicated parameters differ between ranks (module doc). Consumes
    the record: a second step without a backward compares nothing."""
    state = sm.fxshard_state
    record = state.grads.grads
    if not record:
        return
    state.grads.grads = None
    split = state.grads.split
    if not split:  # every rank holds whole gradients: a per-rank statistic is the model's
        return
    grads = {fqn: p.grad for fqn, p in sm.named_parameters() if p.grad is not None}
    changed = [fqn for fqn, g in grads.items()
               if fqn not in record or record[fqn][0]() is not g or record[fqn][1] != g._version]
    if not changed:
        return
    if not state.grads.warned:
        state.grads.warned = True
        warnings.warn(
            f"fxshard: the gradients of {name_few(changed, 3)} in {state.where} were changed in place after "
            f"the backward, outside fxshard. Each rank holds only its pieces of split gradients, so a statistic "
            f"over a whole gradient (a norm, a max) computed on them is this rank's, not the model's: use "
            f"sm.clip_grad_norm_(max_norm) rather than torch.nn.utils.clip_grad_norm_(sm.parameters(), ...). "
            f"fxshard now compares the replicated gradients across ranks at each such step", stacklevel=4)
    # only over the axes that split some parameter: along the others every rank holds the same pieces, so the
    # same per-rank statistics (and a check there would checksum every data-parallel replica's gradients)
    dense = {fqn: g for fqn, g in grads.items() if g.layout == torch.strided}  # a sparse gradient has no checksum
    placements = state.layout.placements
    check_replicas({f"{fqn}.grad": g for fqn, g in dense.items()},
                   {f"{fqn}.grad": tuple(pl if a in split else _NOT_COMPARED for a, pl in enumerate(placements[fqn]))
                    for fqn in dense}, state.layout.mesh, _WHY)


_NOT_COMPARED = object()  # a placement check_replicas skips (not Replicated)


def _split_axes(sm: HasShardedState) -> set[int]:
    """The mesh axes over which some parameter of ``sm`` is split (held in different pieces by different ranks)."""
    placements = sm.fxshard_state.layout.placements
    return {a for fqn, _ in sm.named_parameters() for a, pl in enumerate(placements[fqn])
            if not isinstance(pl, Replicated)}
