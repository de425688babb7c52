"""Batch norm with ``momentum=None`` (a cumulative moving average of the batch statistics), traceable.

torch's ``_BatchNorm.forward`` turns the count of batches seen into a Python number in training
(``1.0 / float(self.num_batches_tracked)``) and passes it to ``F.batch_norm`` as the momentum: a value
read from a tensor, which ``torch.export`` cannot trace (it stopped with a data-dependent guard pointing
at the model's forward). While :func:`cumulative_batch_norm_traceable` is active, such modules (torch's
``BatchNorm1d/2d/3d`` in training, tracking running statistics) run a forward that computes the same
thing with the factor kept a tensor: the output is ``F.batch_norm`` of the batch statistics, and the
running mean and unbiased variance move to ``(1 - f) * running + f * batch`` with ``f = 1 /
num_batches_tracked`` as in eager (up to rounding: eager blends in double on CPU). A split batch gives the
statistics of the whole batch, as every reduction over a split dimension does.
"""

from __future__ import annotations

import contextlib
import types
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["cumulative_batch_norm_traceable"]


def _cumulative_forward(self: nn.modules.batchnorm._BatchNorm, input: torch.Tensor) -> torch.Tensor:
    if not (self.momentum is None and self.training and self.track_running_stats
            and self.num_batches_tracked is not None):
        return type(self).forward(self, input)
    self._check_input_dim(input)
    self.num_batches_tracked.add_(1)
    out = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
    with torch.no_grad():
        dims = [0, *range(2, input.dim())]
        f = (1.0 / self.num_batches_tracked).to(self.running_mean.dtype)
        self.running_mean.mul_(1 - f).add_(input.mean(dims).to(self.running_mean.dtype) * f)
        self.running_var.mul_(1 - f).add_(input.var(dims, correction=1).to(self.running_var.dtype) * f)
    return out


@contextlib.contextmanager
def cumulative_batch_norm_traceable(model: nn.Module) -> Iterator[None]:
    """Requires: ``model`` is about to be traced. Ensures: while active, each of its torch batch-norm modules with
    ``momentum=None`` runs the traceable forward of the module doc (chosen at each call by its mode); after, the
    modules are as before."""
    patched = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
               and type(m).forward is nn.modules.batchnorm._BatchNorm.forward and m.momentum is None
               and "forward" not in m.__dict__]
    for m in patched:
        m.forward = types.MethodType(_cumulative_forward, m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward
