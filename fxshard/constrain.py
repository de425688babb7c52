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
import itertools
from typing import Any, Iterator, Optional

import torch

__all__ = ["constrain", "CONSTRAIN_OP", "constraint_scope", "constraint_spec"]

_SPECS: dict[str, Any] = {}
_COUNTER = itertools.count()
_DEPTH = [0]


@torch.library.custom_op("fxshard::constrain", mutates_args=())
def _constrain(x: torch.Tensor, key: str) -> torch.Tensor:
    return x.clone()


@_constrain.register_fake
def _constrain_fake(x: torch.Tensor, key: str) -> torch.Tensor:
    return torch.empty_like(x)


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.key = inputs[1]


def _splits(spec: Any) -> bool:
    """Whether a spec splits some dim (as opposed to only replicating)."""
    from torch.distributed.tensor import Shard

    from .placements import P, S
    from .styles import AxisSpec

    if isinstance(spec, AxisSpec):
        return isinstance(spec.placement, Shard)
    if isinstance(spec, P):
        return any(e is not None for e in spec)
    items = spec if isinstance(spec, (tuple, list)) else (spec,)
    return any(isinstance(p, (Shard, S)) for p in items)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    # a split layout pins its gradient too (sequence parallel's reduce_scatters in backward); a
    # replicated one does not, so partial gradients can be summed before their single reduction
    if _splits(_SPECS.get(ctx.key)):
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


_FUNCTIONAL = [False]


@contextlib.contextmanager
def constraint_scope(functional: bool = False) -> Iterator[None]:
    """While active (fxshard tracing), ``constrain`` records constraint ops; ``functional`` when the
    traced code may differentiate with ``torch.func`` (``fxshard.jit``)."""
    _DEPTH[0] += 1
    before, _FUNCTIONAL[0] = _FUNCTIONAL[0], functional
    try:
        yield
    finally:
        _DEPTH[0] -= 1
        _FUNCTIONAL[0] = before


def constraint_spec(key: str) -> Any:
    """The spec a recorded constraint key stands for."""
    return _SPECS[key]


def constrain(x: torch.Tensor, spec: Any) -> torch.Tensor:
    """Require ``x`` to be laid out as ``spec`` (``P(...)``, a placement, or one placement per mesh
    axis, where ``None`` leaves that axis free). Identity when not being sharded by fxshard."""
    if _DEPTH[0] == 0 or not isinstance(x, torch.Tensor):
        return x
    key = f"c{next(_COUNTER)}"
    _SPECS[key] = spec
    return _ConstrainFn.apply(x, key) if _FUNCTIONAL[0] else _constrain(x, key)


def record(x: Any, spec: Optional[Any]) -> Any:
    """``constrain`` for hooks: skips non-tensors and ``None`` specs."""
    return constrain(x, spec) if spec is not None and isinstance(x, torch.Tensor) else x
