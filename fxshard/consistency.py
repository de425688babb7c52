"""Detect a plan, mesh or model that differs between ranks at ``shard()`` time.

Ranks that traced different programs would wait in different collectives and
hang; instead every rank exchanges a short description of what it is about to
shard and all of them raise the same readable error on any difference.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .comm_errors import guard_collective
from .errors import ShardingError

__all__ = ["fingerprint", "check_same_on_all_ranks"]


def fingerprint(plan: Optional[Mapping[str, Any]], model: nn.Module, example_inputs: tuple) -> dict[str, str]:
    """Named, comparable descriptions of a plan, model and inputs (``frontend.check_consistent`` adds the
    mesh and specs)."""
    fp: dict[str, str] = {}
    if isinstance(plan, Mapping):
        fp["plan entries"] = repr(list(plan.keys()))
        for key, spec in plan.items():
            fp[f"plan entry {key!r}"] = repr(spec)
    else:
        fp["plan"] = repr(plan)  # not a dict: resolve_plan explains the error on every rank
    fp["model"] = type(model).__name__ + repr([(n, tuple(p.shape)) for n, p in model.named_parameters()])
    fp["modules in eval mode"] = repr([n or "<root>" for n, m in model.named_modules() if not m.training])
    fp["example input shapes"] = repr([tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                                      for x in example_inputs])
    return fp


def check_same_on_all_ranks(fp: dict[str, str]) -> None:
    """Raise ShardingError on every rank if any rank's fingerprint differs (a collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return
    everyone: list[Any] = [None] * dist.get_world_size()
    guard_collective(lambda: dist.all_gather_object(everyone, fp),
                     "comparing what every rank shards (the first collective of shard() or of a new jit signature)")
    ref = everyone[0]
    for rank, other in enumerate(everyone):
        for name in sorted(set(ref) | set(other)):
            if ref.get(name) != other.get(name):
                raise ShardingError(
                    f"{name} differs between rank 0 ({ref.get(name, 'absent')}) and rank {rank} "
                    f"({other.get(name, 'absent')}); every rank must call shard() (or the jitted function) with the "
                    f"same plan, mesh, model, modes and input shapes"
                )
