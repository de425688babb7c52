"""Mixed precision: ``torch.autocast`` around sharded programs, and the dtype Partial sums are reduced in.

A program is a fixed ATen graph, so autocast's per-op casts must be in it: ``shard()`` reads the autocast state
of the mesh's device type (``AutocastState.current``) and ``trace.trace_forward`` runs the model's forward
inside that state (export records it as ``wrap_with_autocast`` regions, which the decomposition inlines as
explicit ``_to_copy`` nodes; Python code in the forward sees the dtypes eager sees). Every later trace and
every run of a program happens with autocast off (``autocast_off``): the casts are in the graph, and an
autocast around the program would cast its ops again. A call under another autocast state than the one the
programs were traced for raises (``check_autocast``): the state (enabled, dtype, device type, cache flag) is
part of what a program computes.

Under autocast a reduction of a Partial sum held in a narrower float (a row-split bf16 matmul's output) runs
in ``REDUCE_DTYPE`` (float32), then casts back (``MeshInfo.reduce_dtype``, ``transition.plan_transition``):
eager's single matmul accumulates in float32 and rounds once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from .errors import ShardingError

# The device types whose autocast fxshard follows: fxshard::attention has autocast kernels for them, and
# export's autocast regions are watched for no_grad blocks on them (tracing/export.py).
AUTOCAST_DEVICES = ("cpu", "cuda")

__all__ = ["AutocastState", "REDUCE_DTYPE", "autocast_off", "check_autocast", "describe"]

# the dtype Partial sums of narrower floats are reduced in under autocast (as FSDP2's reduce_dtype=float32)
REDUCE_DTYPE = torch.float32


@dataclass(frozen=True)
class AutocastState:
    """An enabled ``torch.autocast`` for one device type: its dtype and whether it caches casts of parameters
    (``cache_enabled``: one cast of a parameter per autocast region, so gradients of its uses sum in the low
    dtype; without the cache each use casts, and they sum in the parameter's dtype)."""

    device_type: str
    dtype: torch.dtype
    cache_enabled: bool = True

    @staticmethod
    def current(device_type: str) -> Optional["AutocastState"]:
        """The autocast in effect now for ``device_type``, or None when it is off."""
        if not torch.is_autocast_enabled(device_type):
            return None
        return AutocastState(device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_cache_enabled())

    def context(self) -> torch.autocast:
        """A ``torch.autocast`` entering this state."""
        return torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=self.cache_enabled)

    def __str__(self) -> str:
        cache = "" if self.cache_enabled else ", cache_enabled=False"
        return f"torch.autocast({self.device_type!r}, dtype={self.dtype}{cache})"


def describe(state: Optional[AutocastState], device_type: str) -> str:
    """``state`` in words (``"no autocast"`` for None)."""
    return str(state) if state is not None else f"no autocast (for {device_type!r})"


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """A context with autocast off for ``device_type`` (nothing is entered when it is off already). A plain
    ``torch.autocast``/``nullcontext``, not a generator: TorchDynamo traces these where a ShardedModule's
    forward is compiled (a generator context made it skip the frame and compile the pieces check's
    collective instead)."""
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def check_autocast(where: str, device_type: str, traced: Optional[AutocastState]) -> None:
    """Requires: ``traced`` is the autocast state the programs of ``where`` were traced in (None: none).
    Ensures: returns when the autocast state of ``device_type`` now is the same, else raises a ShardingError
    naming both: the program would compute in other dtypes than eager does under the state given."""
    now = AutocastState.current(device_type)
    if now == traced:
        return
    if traced is None:
        fix = (f"call shard() inside the same {now} context to trace the programs with its casts, or call the "
               f"module outside it")
    elif now is None:
        fix = (f"call the module inside {traced} as when it was sharded, or shard the model outside autocast "
               f"for calls without it")
    else:
        fix = f"call the module inside {traced}, or shard the model inside {now}"
    raise ShardingError(
        f"{where} under {describe(now, device_type)}, but its programs were traced under "
        f"{describe(traced, device_type)} at shard(): a program is a fixed ATen graph whose casts (which ops run "
        f"in which dtype) autocast decided while tracing, so under another state it would not compute what eager "
        f"computes; {fix}")
