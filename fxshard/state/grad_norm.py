"""Gradient norm and clipping over a ShardedModule's parameters as the unsharded model has them.

A rank holds pieces of split parameters (and their gradients) and whole copies of
replicated ones, so ``torch.nn.utils.clip_grad_norm_(sm.parameters(), ...)`` would
compute each rank's own norm and clip each rank by another factor. Here every
gradient's piece contributes its ``sum |g|^p`` (or ``max |g|``), reduced over the
mesh axes that split it and not over those that replicate it, so every rank gets the
norm of the full gradients and scales its pieces by the same factor.
"""

from __future__ import annotations

import math
import torch
import torch.distributed as dist

from .sharded_state import HasShardedState

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(sm: HasShardedState, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for ``sm`` (a ShardedModule): see ``ShardedModule.clip_grad_norm_``."""
    p = float(norm_type)
    inf = math.isinf(p)
    parts: dict[tuple, list[torch.Tensor]] = {}  # (mesh, split axes) -> local contributions
    grads = []
    layout = sm.fxshard_state.layout
    for fqn, param in sm.named_parameters():
        if param.grad is None:
            continue
        view = layout.dtensor(fqn, param.grad.detach())  # no communication: placements and this rank's piece
        local = view.to_local()
        grads.append(param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad)
        axes = tuple(i for i, pl in enumerate(view.placements) if not pl.is_replicate())  # Shard, _StridedShard
        norm = torch.linalg.vector_norm(local, p)
        # by the mesh's value: under FSDP2 every view has a mesh object of its own, all equal
        parts.setdefault((view.device_mesh, axes), []).append(norm if inf else norm ** p)
    if not grads:
        return torch.tensor(0.0)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    totals = []
    for (mesh, axes), terms in sorted(parts.items(), key=lambda kv: kv[0][1]):  # stable: same order on every rank
        t = torch.stack(terms).max() if inf else torch.stack(terms).sum()
        for axis in axes:
            dist.all_reduce(t, op=op, group=mesh.get_group(axis))
        totals.append(t)
    total = torch.stack(totals).max() if inf else torch.stack(totals).sum() ** (1.0 / p)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {p} for gradients from `parameters` is non-finite, so it "
                           f"cannot be clipped. To disable this error and scale the gradients by the non-finite "
                           f"norm anyway, set `error_if_nonfinite=False`")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total
