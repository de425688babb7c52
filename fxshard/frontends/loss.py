"""``loss_parallel(model, loss_fn)``: the loss computed on the model's output inside the sharded program,
with the model's own parameter names (no wrapper prefix in checkpoints)."""

from __future__ import annotations

from typing import Any, Callable

import torch.nn as nn

from ..core.errors import ShardingError

__all__ = ["loss_parallel", "WithLoss"]


class WithLoss(nn.Module):
    """``model`` followed by ``loss_fn``; its parameters, buffers, submodules and mode *are* the model's
    (shared, not wrapped), so names and ``state_dict()`` keys are the model's exactly."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., Any], n_targets: int = 1) -> None:
        object.__setattr__(self, "_model", model)  # before nn.Module.__init__, which sets ``training``
        super().__init__()
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._non_persistent_buffers_set = model._non_persistent_buffers_set
        self._modules = model._modules
        self.loss_fn = loss_fn
        self.n_targets = n_targets

    @property  # type: ignore[override]
    def training(self) -> bool:
        return self._model.training

    @training.setter
    def training(self, mode: bool) -> None:
        self._model.training = mode

    def _get_name(self) -> str:
        return f"{type(self._model).__name__}+loss"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``loss_fn(model(*inputs, **kwargs), *targets)``: the last ``n_targets`` positional arguments are
        the targets."""
        n = self.n_targets
        if len(args) < n:
            raise ShardingError(f"loss_parallel: the call has {len(args)} positional argument(s), but the last "
                                f"{n} are the loss targets; pass model inputs, then the targets")
        inputs, targets = args[: len(args) - n], args[len(args) - n:]
        return self.loss_fn(self._model(*inputs, **kwargs), *targets)


def loss_parallel(model: nn.Module, loss_fn: Callable[..., Any], *, n_targets: int = 1) -> WithLoss:
    """``model`` with ``loss_fn`` applied to its output, to shard as one program (tutorial code computes the
    loss outside the model: ``loss = loss_fn(model(x), y)`` becomes ``loss = sm(x, y)``).

    With class-sharded logits (a ``ColwiseParallel`` head), cross entropy then communicates only per-token
    statistics, never the logits, and needs no context manager. Unlike an ``nn.Module`` wrapper holding the
    model as a child, the result shares the model's parameters, buffers, submodules and mode, so
    ``sm.state_dict()``/``sm.full_state_dict()`` keys and plan FQNs are the model's own.
    """
    if not isinstance(model, nn.Module) or not callable(loss_fn):
        raise ShardingError(f"loss_parallel(model, loss_fn): got {type(model).__name__} and "
                            f"{type(loss_fn).__name__}; pass an nn.Module and a callable (e.g. F.cross_entropy)")
    return WithLoss(model, loss_fn, n_targets)
