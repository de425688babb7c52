"""The decomposition tables fxshard traces with: core ATen minus the kernels kept whole.

``decomposition_table`` is what ``trace_forward`` (``export.py``) decomposes the exported forward with;
``joint_decomposition_table`` what every ``make_fx`` trace uses (the joint graph of ``fxshard.shard``,
``fxshard.jit``'s functions). Kept whole: the fused kernels with sharding rules (``FUSED_FORWARD``,
``FUSED_BACKWARD``; ``FUSED_GRAD_ARGS`` says which arguments their backward differentiates) and the ops
whose eager derivative differs from their decomposition's (``EAGER_DERIVATIVE``). Replaced: softmaxes
(their row max a stop-gradient), ``index_fill``, ``copy``, ``_safe_softmax`` and ``scatter.value``, by
forms whose autodiff is eager's derivative or whose rule can split more.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

aten = torch.ops.aten

__all__ = ["decomposition_table", "joint_decomposition_table", "EAGER_DERIVATIVE", "FUSED_FORWARD", "FUSED_BACKWARD",
           "FUSED_GRAD_ARGS"]


# Fused CPU kernels kept out of the decompositions: each has a sharding rule (fxshard/rules/), and
# decomposing them costs ~25% of a training step in small ops (benchmarks/profile_step.py). fxshard's traces
# route F.scaled_dot_product_attention to fxshard::attention (fxshard/ops/attention.py) before any decomposition,
# so CPU's attention kernel appears only in a graph that calls it directly.
FUSED_FORWARD = (
    aten._scaled_dot_product_flash_attention_for_cpu.default,  # rules/attention.py
)
# The positional arguments each fused forward's backward differentiates; a gradient wanted for any
# other tensor argument (a learned attn_mask) makes the joint trace decompose that call instead.
FUSED_GRAD_ARGS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: (0, 1, 2),  # query, key, value
}
FUSED_BACKWARD = (
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,  # rules/attention.py
    aten.native_layer_norm_backward.default,  # rules/norm.py
    aten.embedding_dense_backward.default,  # rules/embedding.py
    aten.gelu_backward.default,  # rules/pointwise.py (GRAD kind), as are the four below
    aten.silu_backward.default,
    aten.threshold_backward.default,
    aten.sigmoid_backward.default,
    aten.tanh_backward.default,
)


# Ops kept whole (not decomposed) wherever fxshard traces, so that the joint trace's autograd applies eager's
# derivative formula to them (derivatives.yaml; the backward ops it calls are decomposed or in FUSED_BACKWARD).
# Differentiating their decompositions gives other gradients: NaN where an unselected where() branch
# overflows or divides by zero (0 * inf: softplus and mish for large inputs, celu's exp, sinc at 0, std of
# a constant row, binary_cross_entropy of a probability of exactly 0 or 1), other values at kinks
# (hardswish, hardsigmoid at +-3) or without eager's clamps (binary_cross_entropy's 1e-12, log_ndtr's
# formula). Each has a sharding rule (rules/pointwise.py, rules/reduction.py).
EAGER_DERIVATIVE = (
    aten.softplus.default,
    aten.mish.default,
    aten.celu.default,
    aten.sinc.default,
    aten.hardswish.default,
    aten.hardsigmoid.default,
    aten.special_log_ndtr.default,
    aten.std.correction,
    aten.std_mean.correction,
    aten.binary_cross_entropy.default,
)


def decomposition_table(stop_gradient: Any = torch.Tensor.detach) -> Any:
    """The core-ATen decompositions minus ``FUSED_FORWARD`` and ``EAGER_DERIVATIVE``, plus softmax
    decompositions, for ``make_fx``.

    Ensures: ``_softmax``/``_log_softmax`` decompose (loss parallel needs a split class dim to become
    Partial max/sum reductions), their row max through ``stop_gradient`` (``detach`` where the tracer
    runs autograd itself, as the joint trace does; the forward's graph marks it with
    ``fxshard::stop_gradient``); the ops in ``FUSED_FORWARD`` and ``EAGER_DERIVATIVE`` stay whole (they
    have rules).
    CompositeImplicitAutograd ops need no entry: below autograd, where ``make_fx`` traces, they run as
    their composite kernels (``torch.export.default_decompositions()`` lists them all for export's
    pre-dispatch graphs, and collecting them costs ~0.2 s per process).
    """
    table = dict(_core_table())
    for op in FUSED_FORWARD + EAGER_DERIVATIVE:
        table.pop(op, None)
    table[aten._softmax.default], table[aten._log_softmax.default] = _softmaxes(stop_gradient)
    table[aten.index_fill.int_Tensor] = _index_fill
    table[aten.index_fill.int_Scalar] = _index_fill
    table[aten.copy.default] = _copy
    table[aten._safe_softmax.default] = _safe_softmax
    return table


@functools.lru_cache(maxsize=None)
def _core_table() -> dict:
    from ..core.torch_compat import core_aten_decompositions_post_autograd

    return core_aten_decompositions_post_autograd()


def _softmaxes(stop: Any) -> tuple[Any, Any]:
    """``_softmax`` and ``_log_softmax`` decomposed as torch does, except that the row max they subtract
    goes through ``stop`` (a stop-gradient). Softmax is shift invariant, so no gradient flows through
    that max (eager's fused backward has none); differentiating it cost six extra passes over the
    logits in every backward, and collectives when the class dim is split."""
    from ..core.torch_compat import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes, softmax_unbacked_safe_amax

    def shifted(x: torch.Tensor, dim: int, half_to_float: bool) -> tuple[torch.Tensor, torch.dtype]:
        x = x.contiguous()
        compute, result = elementwise_dtypes(x, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)
        x = x.to(compute)
        return x - stop(softmax_unbacked_safe_amax(x, dim)), compute if half_to_float else result

    def softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
        sh, dtype = shifted(x, dim, half_to_float)
        e = torch.exp(sh)
        return (e / torch.sum(e, dim, keepdim=True)).to(dtype)

    def log_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
        sh, dtype = shifted(x, dim, half_to_float)
        return (sh - torch.log(torch.sum(torch.exp(sh), dim, keepdim=True))).to(dtype)

    return softmax, log_softmax


def _index_fill(x: torch.Tensor, dim: int, index: torch.Tensor, value: Any) -> torch.Tensor:
    """``index_fill`` as a ``where`` over a mask of the filled positions along ``dim``.

    torch's own decomposition writes an expanded ``value`` with ``index_put``, whose backward sums the
    gradient once per occurrence of a repeated index; eager's ``index_fill`` backward counts each
    filled position once, and so does ``where``.
    """
    dim = dim % max(x.dim(), 1)
    size = x.shape[dim] if x.dim() else 1
    idx = index.reshape(-1)
    idx = torch.where(idx < 0, idx + size, idx)
    hit = (torch.arange(size, device=x.device).unsqueeze(1) == idx.unsqueeze(0)).any(1)
    if x.dim():
        hit = hit.reshape([size if d == dim else 1 for d in range(x.dim())])
    else:
        hit = hit.reshape(())
    value = value if isinstance(value, torch.Tensor) else torch.scalar_tensor(value, dtype=x.dtype, device=x.device)
    return torch.where(hit, value.to(x.dtype), x)


def _copy(x: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """Functional ``copy`` (what ``x[..., :d].copy_(y)`` and ``x[:, i] = y`` export to): ``src`` cast to
    ``x``'s dtype and broadcast to ``x``'s shape. autograd has no derivative for ``aten.copy``."""
    return src.to(dtype=x.dtype, device=x.device).expand(x.shape).clone()


# The training graph differentiates the decomposed forward: these replace torch's decompositions with ones
# whose autodiff is eager's derivative.

def _safe_softmax(x: torch.Tensor, dim: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Softmax along ``dim`` with rows that are all -inf giving 0 (and a 0 gradient, as eager)."""
    empty = (x == float("-inf")).all(dim, keepdim=True)
    out = torch.softmax(x.masked_fill(empty, 0), dim, dtype=dtype)
    return out.masked_fill(empty, 0)


def _scatter_value(self: torch.Tensor, dim: int, index: torch.Tensor, value: Any) -> torch.Tensor:
    """``scatter.value`` (nll_loss's backward) as ``scatter_add`` + ``where``: ``scatter_add``'s rule can
    split the scattered dim (a masked local scatter), so a class-split loss needs no gather there."""
    # counted in int32: a narrow dtype of self (uint8, bool) could wrap a count of repeated indices to 0
    hits = torch.zeros_like(self, dtype=torch.int32).scatter_add(dim, index, torch.ones_like(index, dtype=torch.int32))
    return torch.where(hits > 0, value, self)


@functools.lru_cache(maxsize=None)
def _make_fx_table() -> dict:
    table = decomposition_table()
    table[aten.scatter.value] = _scatter_value
    for op in FUSED_FORWARD + FUSED_BACKWARD:
        table.pop(op, None)
    return table


def joint_decomposition_table() -> dict:
    """The one table graphs traced with ``make_fx`` use: the joint (forward + backward) graph of
    ``fxshard.shard`` and ``fxshard.jit``'s functions (a fresh copy: callers may change it).

    Ensures: core ATen plus :func:`decomposition_table` (the table ``trace_forward`` exports with)
    and ``scatter.value`` as ``scatter_add`` + ``where``, minus ``FUSED_FORWARD``, ``EAGER_DERIVATIVE``
    and ``FUSED_BACKWARD`` (kernels with sharding rules stay one node each).
    """
    return dict(_make_fx_table())

