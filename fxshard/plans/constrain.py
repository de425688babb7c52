"""``fxshard.constrain``: pin an activation's sharding from inside model code.

Like ``jax.lax.with_sharding_constraint``: outside fxshard tracing it returns
its input unchanged; while fxshard traces a model it records an identity op
``fxshard::constrain(x, key)`` whose placements propagation treats as frozen
(the value is redistributed to them; consumers start from them). The gradient
of a split constraint is pinned to the same layout; that of a replicated one
is left to propagation (so partial gradients from several consumers are summed
before one reduction). The localize pass
removes the op again, so the per-rank program holds only the collectives.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch

__all__ = ["constrain", "CONSTRAIN_OP", "constraint_kind", "constraint_scope", "record"]


@dataclass
class _Scope:
    """One fxshard trace: the specs its ``constrain`` calls recorded, by key."""

    functional: bool
    specs: dict[str, Any] = field(default_factory=dict)


_SCOPE: ContextVar[Optional[_Scope]] = ContextVar("fxshard_constraint_scope", default=None)
_SPLIT, _FREE = "split", "free"


@torch.library.custom_op("fxshard::constrain", mutates_args=())
def _constrain(x: torch.Tensor, key: str) -> torch.Tensor:
    return x.clone()


@_constrain.register_fake
def _constrain_fake(x: torch.Tensor, key: str) -> torch.Tensor:
    # x's own strides: the sharded program drops the constraint and its consumers read x itself (a view
    # traced on a row-major stand-in of a non-contiguous x would fail there)
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.key = inputs[1]


def _splits(spec: Any) -> bool:
    """Whether a spec splits some dim (as opposed to only replicating)."""
    from torch.distributed.tensor import Shard

    from ..core.placements import P, S
    from .styles import AxisSpec

    if isinstance(spec, AxisSpec):
        return isinstance(spec.placement, Shard)
    if isinstance(spec, P):
        return any(e is not None for e in spec)
    items = spec if isinstance(spec, (tuple, list)) else (spec,)
    return any(isinstance(p, (Shard, S)) for p in items)


def constraint_kind(key: str) -> str:
    """What a constraint's key says about its gradient: ``"split"`` (pinned too) or ``"free"``; all
    else in the key only tells constraints apart."""
    return key.rsplit("_", 1)[-1]


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    # a split layout pins its gradient too (sequence parallel's reduce_scatters in backward); a
    # replicated one does not, so partial gradients can be summed before their single reduction.
    # The key says which (the joint graph is traced after the scope that recorded the spec closed).
    if constraint_kind(ctx.key) == _SPLIT:
        return _constrain(grad, ctx.key), None
    return grad, None


_constrain.register_autograd(_backward, setup_context=_setup)

CONSTRAIN_OP = torch.ops.fxshard.constrain.default


class _ConstrainFn(torch.autograd.Function):
    """The constraint with the same gradient rule as an autograd.Function that ``torch.func``
    transforms accept (the custom op's own autograd is not): what ``fxshard.jit`` traces."""

    @staticmethod
    def forward(x: torch.Tensor, key: str) -> torch.Tensor:  # type: ignore[override]
        return _constrain(x, key)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        _setup(ctx, inputs, output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        return _backward(ctx, grad)


@contextlib.contextmanager
def constraint_scope(functional: bool = False) -> Iterator[dict[str, Any]]:
    """While active (fxshard tracing), ``constrain`` records constraint ops; yields the table of the
    specs they stand for, by key (``tracing/annotate.py::constraint_table`` reads it). ``functional``
    when the traced code may differentiate with ``torch.func`` (``fxshard.jit``). A scope opened
    inside another records into the outer table."""
    outer = _SCOPE.get()
    scope = _Scope(functional or (outer.functional if outer else False), outer.specs if outer else {})
    token = _SCOPE.set(scope)
    try:
        yield scope.specs
    finally:
        _SCOPE.reset(token)


def constrain(x: torch.Tensor, spec: Any) -> torch.Tensor:
    """Require ``x`` to be laid out as ``spec`` (``P(...)``, a placement, or one placement per mesh
    axis, where ``None`` leaves that axis free). Identity when not being sharded by fxshard."""
    scope = _SCOPE.get()
    if scope is None or not isinstance(x, torch.Tensor):
        return x
    key = f"c{len(scope.specs)}_{_SPLIT if _splits(spec) else _FREE}"
    scope.specs[key] = spec
    return _ConstrainFn.apply(x, key) if scope.functional else _constrain(x, key)


def record(x: Any, spec: Optional[Any]) -> Any:
    """``constrain`` for hooks: skips non-tensors and ``None`` specs."""
    return constrain(x, spec) if spec is not None and isinstance(x, torch.Tensor) else x
