"""Gradients the model's own code defines, while ``torch.export`` traces its forward.

fxshard exports the forward and derives the backward from the traced ops (``tracing/joint.py``). Code
that gives a value a gradient other than the derivative of its forward would be lost on the way,
silently: ``torch.export`` (non-strict) runs an ``autograd.Function``'s ``forward`` as plain ops and
drops its ``backward``, and a gradient hook registered on a tensor inside ``forward`` never runs.
While :func:`custom_gradients_checked` is active:

* ``torch.utils.checkpoint``'s reentrant ``CheckpointFunction`` (``checkpoint(..., use_reentrant=True)``,
  HF's ``gradient_checkpointing_enable({"use_reentrant": True})``) runs its function inline:
  checkpointing changes what is kept for the backward, not any value or gradient (its recompute
  restores the RNG state), and ``shard(..., remat=...)`` is fxshard's way to recompute. As in eager, its outputs need no gradient
  when none of its tensor inputs requires one.
* any other ``autograd.Function`` applied to a tensor that requires grad, ``Tensor.register_hook``
  on one, and backward hooks on the model's modules (full ones, which export runs through a Function,
  and the deprecated ``register_backward_hook``, which hooks a ``grad_fn``) raise a ShardingError naming it and the way out (a ``torch.library.custom_op`` with
  ``register_autograd`` keeps its backward through export and the joint trace). Applied where no
  gradient is needed (frozen weights, ``torch.no_grad()``), a Function's forward is all that runs in eager
  too, and tracing it is exact. So is a Function whose backward computes exactly the derivative of its
  forward (a hand-written backward for speed): :func:`allow_autograd_function` declares one, and
  ``_DERIVATIVE_BACKWARDS`` lists those known in libraries.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.utils.checkpoint
from ..core.torch_compat import pytree

from ..core.errors import ShardingError
from ..core.torch_compat import (CUSTOM_OP_AUTOGRAD_MODULE_PREFIX, TORCH_DERIVATIVE_BACKWARDS, BackwardHookFunction,
                           classmethod_function)

__all__ = ["custom_gradients_checked", "allow_autograd_function"]

_FIX = ("fxshard derives the backward from the traced forward ops. Give the op its own gradient as a "
        "torch.library.custom_op with register_autograd (torch's way to keep a custom backward through "
        "torch.export; fxshard runs such an op replicated)")

# the autograd.Function a custom op's register_autograd generates: the op stays one node in the export
_CUSTOM_OP_AUTOGRAD = CUSTOM_OP_AUTOGRAD_MODULE_PREFIX
# Functions whose backward is the derivative of their forward, by qualified name. PhimoeMultiplier: the
# backward is the softmax Jacobian-vector product of the gathered gate (checked against autodiff in
# tests/test_custom_gradients.py)
_DERIVATIVE_BACKWARDS = {"transformers.models.phimoe.modeling_phimoe.PhimoeMultiplier", *TORCH_DERIVATIVE_BACKWARDS}


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def allow_autograd_function(cls: type) -> type:
    """Declare that ``cls``, a ``torch.autograd.Function`` subclass, has a backward that computes exactly the
    derivative of its forward, so that ``shard()`` may trace its forward and differentiate that (what it
    refuses by default: ``torch.export`` keeps only the forward). Returns ``cls`` (usable as a decorator).

    Requires: ``cls`` subclasses ``torch.autograd.Function``, else a ShardingError. Ensures: later traces
    apply it without raising. Declaring a Function whose backward is something else (a straight-through
    estimator, a gradient reversal) makes fxshard's gradients differ from eager's, silently.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        raise ShardingError(f"allow_autograd_function expects a torch.autograd.Function subclass, got {cls!r}; "
                            f"pass the class whose .apply the model calls")
    _DERIVATIVE_BACKWARDS.add(_qualified(cls))
    return cls


def _needs_grad(values: Any) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(values))


def _backward_hook_error(where: str) -> ShardingError:
    return ShardingError(
        f"the model has a backward hook on {where} (register_full_backward_hook, register_full_backward_pre_hook "
        f"or register_backward_hook), and fxshard traces the forward into one program and derives the backward "
        f"itself, so the hook would never run. Remove it before shard() and register it on the ShardedModule "
        f"(its local inputs and outputs), or shard that submodule on its own")


def _refuse_backward_hooks(model: torch.nn.Module) -> None:
    from torch.nn.modules import module as nn_module

    if nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks:
        raise _backward_hook_error("every module (torch.nn.modules.module.register_module_full_backward_hook)")
    for fqn, m in model.named_modules():
        if m._backward_hooks or m._backward_pre_hooks:
            raise _backward_hook_error(repr(fqn) if fqn else "the model itself")


def _function_error(cls: type) -> ShardingError:
    if issubclass(cls, BackwardHookFunction):  # a hook added while tracing (the modules were checked before)
        return _backward_hook_error("a module")
    return ShardingError(
        f"the forward applies the torch.autograd.Function {_qualified(cls)} to a tensor that requires grad; "
        f"torch.export traces only its forward, so its backward would be silently replaced by the derivative "
        f"of the forward ops. {_FIX}; if its backward is exactly that derivative (a faster hand-written one), "
        f"declare it with fxshard.allow_autograd_function({cls.__qualname__})")


@contextlib.contextmanager
def custom_gradients_checked(model: torch.nn.Module) -> Iterator[None]:
    """Requires: no backward hooks on ``model``, its submodules or all modules (else a ShardingError naming
    where). While active (around ``torch.export.export`` of ``model``'s forward), ``autograd.Function.apply``
    and ``Tensor.register_hook`` behave as the module doc says. Restores both on exit."""
    _refuse_backward_hooks(model)
    function_apply = torch.autograd.Function.__dict__["apply"]
    register_hook = torch.Tensor.register_hook
    apply = classmethod_function(function_apply)

    def checked_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if cls is torch.utils.checkpoint.CheckpointFunction:
            run, _preserve_rng, *inputs = args
            with torch.set_grad_enabled(_needs_grad(inputs)):
                return run(*inputs)
        if (_needs_grad((args, kwargs)) and not cls.__module__.startswith(_CUSTOM_OP_AUTOGRAD)
                and _qualified(cls) not in _DERIVATIVE_BACKWARDS):
            raise _function_error(cls)
        return apply(cls, *args, **kwargs)

    def checked_register_hook(self: torch.Tensor, hook: Any) -> Any:
        if self.requires_grad:
            name = getattr(hook, "__qualname__", type(hook).__name__)
            raise ShardingError(
                f"the forward registers a gradient hook ({name}) on a tensor of shape {list(self.shape)} with "
                f"Tensor.register_hook; the hook would never run, so the gradient would silently differ from "
                f"eager. {_FIX} (for example an identity op whose backward is the hook)")
        return register_hook(self, hook)

    torch.autograd.Function.apply = classmethod(checked_apply)  # type: ignore[method-assign,assignment]
    torch.Tensor.register_hook = checked_register_hook  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.autograd.Function.apply = function_apply  # type: ignore[method-assign]
        torch.Tensor.register_hook = register_hook  # type: ignore[method-assign]
