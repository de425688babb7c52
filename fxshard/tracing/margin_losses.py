"""The margin losses as eager computes and differentiates them.

torch decomposes ``multilabel_margin_loss`` and ``multi_margin_loss`` above autograd (a Python kernel
for the Autograd key runs before ``make_fx``'s table is consulted) into a program that is wrong (the
slots after a target's first -1) or differentiates unlike eager (``clamp_min`` passes a gradient at an
exact 0). ``replace_above_autograd`` points an exported graph's nodes of them at this module's
replacements (``trace_forward``); ``margin_losses_as_eager`` runs the replacements while a Python
function is traced (``fxshard.jit``).
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..core.torch_compat import C_NN
from ..core.torch_compat import nn_reduction as _Reduction

aten = torch.ops.aten

__all__ = ["margin_losses_as_eager", "replace_above_autograd"]


def _multilabel_margin_loss_forward(x: torch.Tensor, target: torch.Tensor, reduction: int
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``multilabel_margin_loss_forward`` as eager computes it: the labels of a sample are its target slots
    before the first -1; the loss sums ``relu(1 - x[label] + x[c]) / C`` over them and the classes ``c``
    that are not labels. torch's decomposition keeps the slots after the first -1 (each a hinge against
    class 0), and its ``clamp_min`` passes a gradient where a term is exactly 0, which eager's does not."""
    xs, ts = torch.atleast_2d(x), torch.atleast_2d(target)
    classes = xs.shape[1]
    idx = torch.arange(classes, device=ts.device)
    end = torch.amin(torch.where(ts == -1, idx, classes), dim=-1, keepdim=True)
    valid = idx < end  # [N, slot]
    labels = torch.where(valid, ts, 0)
    is_target = (idx == torch.where(valid, ts, -1).unsqueeze(-1)).any(1)  # [N, C]
    hinge = torch.relu(1.0 - torch.gather(xs, -1, labels).T.unsqueeze(-1) + xs) / classes  # [slot, N, C]
    per_sample = torch.where(is_target | ~valid.T.unsqueeze(-1), 0, hinge).sum(dim=(0, -1))
    if reduction == 1:  # torch's Reduction.MEAN
        loss = per_sample.mean()
    elif reduction == 2:  # SUM
        loss = per_sample.sum()
    else:
        loss = per_sample.reshape(x.shape[:-1])
    return loss, is_target.to(x.dtype).reshape(target.shape)


def _multilabel_margin_loss(x: torch.Tensor, target: torch.Tensor, reduction: int = 1) -> torch.Tensor:
    return _multilabel_margin_loss_forward(x, target, reduction)[0]


def _multi_margin_loss(x: torch.Tensor, target: torch.Tensor, p: int = 1, margin: float = 1,
                       weight: Optional[torch.Tensor] = None, reduction: int = 1) -> torch.Tensor:
    """``multi_margin_loss`` as torch decomposes it, with the hinge a relu: eager's backward passes no
    gradient where ``margin - x[target] + x[c]`` is exactly 0; ``clamp_min``'s does."""
    xs, target = torch.atleast_2d(x), torch.atleast_1d(target).unsqueeze(1)
    z = torch.relu(margin - torch.gather(xs, 1, target) + xs)
    z = z if p == 1 else z * z
    if weight is not None:
        z = z * torch.atleast_1d(weight)[target]
    z = torch.where(torch.arange(xs.shape[1], device=xs.device) != target, z, 0)
    if reduction == 1:  # torch's Reduction.MEAN
        return z.mean()
    if reduction == 2:  # SUM
        return z.sum() / z.shape[1]
    return z.mean(dim=1).reshape(x.shape[:-1])


# Ops torch decomposes above autograd (a Python kernel for the Autograd key runs its decomposition before
# make_fx's table is consulted) into a program that is wrong or differentiates unlike eager: trace_forward
# points export's nodes of them here.
_ABOVE_AUTOGRAD = {
    aten.multilabel_margin_loss.default: _multilabel_margin_loss,  # what export's graph holds
    aten.multilabel_margin_loss_forward.default: _multilabel_margin_loss_forward,
    aten.multi_margin_loss.default: _multi_margin_loss,
}


class margin_losses_as_eager(TorchFunctionMode):
    """While active, ``torch.nn.functional``'s (and the C functions they call, ``torch_compat.C_NN``) margin losses of ``_ABOVE_AUTOGRAD``
    run its replacements: ``make_fx`` traces of Python functions (``fxshard.jit``) then hold them where
    torch's Autograd-key decomposition would run (export graphs are fixed by ``replace_above_autograd``).

    Ensures: values and gradients as eager's kernels; anything else (and a ``p`` torch rejects) runs as called."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        a: Optional[dict] = None
        if func in _MARGIN_FUNCTIONAL:
            bound = inspect.signature(func).bind(*args, **kwargs)
            bound.apply_defaults()
            a = dict(bound.arguments)
            size_average, reduce, reduction = a.pop("size_average"), a.pop("reduce"), a.pop("reduction")
            a["reduction"] = (_Reduction.legacy_get_enum(size_average, reduce)
                              if size_average is not None or reduce is not None else _Reduction.get_enum(reduction))
        elif func in _MARGIN_C:  # builtins, by their parameters' names; left to torch when some are defaulted
            names = _MARGIN_C[func][1]  # (the bindings' defaults are not the schema's: reduction acts as none)
            given = {**dict(zip(names, args)), **kwargs}
            a = {n: given[n] for n in names} if set(given) == set(names) else None
        # the replacements take the rest in the same order; what torch rejects runs as called (and raises)
        if a is not None and a.get("p", 1) in (1, 2) and (a.get("weight") is None or a["weight"].dim() == 1):
            return (_MARGIN_FUNCTIONAL.get(func) or _MARGIN_C[func][0])(*a.values())
        return func(*args, **kwargs)


_MARGIN_FUNCTIONAL = {F.multilabel_margin_loss: _multilabel_margin_loss, F.multi_margin_loss: _multi_margin_loss}
_MARGIN_C = {C_NN.multilabel_margin_loss: (_multilabel_margin_loss, ("input", "target", "reduction")),
             C_NN.multi_margin_loss: (_multi_margin_loss,
                                              ("input", "target", "p", "margin", "weight", "reduction"))}


def replace_above_autograd(gm: fx.GraphModule) -> None:
    """Requires: ``gm`` an exported program's graph. Ensures: every node of an op in ``_ABOVE_AUTOGRAD`` (in
    ``gm`` and its subgraphs) calls its replacement, which computes and differentiates as eager's kernel."""
    for mod in gm.modules():
        if isinstance(mod, fx.GraphModule):
            found = [n for n in mod.graph.nodes if n.op == "call_function" and n.target in _ABOVE_AUTOGRAD]
            for n in found:
                n.target = _ABOVE_AUTOGRAD[n.target]
            if found:  # nearly no model has one: its code is not generated again for nothing
                mod.recompile()

