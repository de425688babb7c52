"""Pass 1, trace: model + example inputs -> core-ATen fx graph with global shapes.

Requires: an nn.Module whose forward is traceable by ``torch.export``
(non-strict) with the example inputs; parameters may live on the meta device.
Ensures: a GraphModule whose placeholders are, in order, one per unique
parameter/buffer tensor (tied parameters are one placeholder), lifted
constants, then the flattened tensor leaves of ``(args, kwargs)``; every node
carries ``meta["val"]`` (a fake tensor with global, possibly symbolic, shape).
``_softmax``/``_log_softmax`` are decomposed so a split softmax dim becomes
Partial reductions, while the fused kernels in ``FUSED_FORWARD`` stay fused and the ops in
``EAGER_DERIVATIVE`` whole (the joint trace's autograd then applies eager's derivative to them);
shape assertions and no-op clones are dropped (the former refer to global sizes). Ops torch decomposes
above autograd into a wrong program (``_ABOVE_AUTOGRAD``: the margin losses) are replaced first, and
attention becomes one device-neutral ``fxshard::attention`` node (``fxshard/attention_op.py::route_exported``;
with dropout, or under ``sdpa_kernel(SDPBackend.MATH)``, torch's math form, decomposed).
Export's graph is decomposed by re-tracing it with ``make_fx`` over functional
fake tensors (``_decomposed``: what ``run_decompositions`` gives, at half its
cost); buffers the forward updates in place are its first outputs.
Stop-gradients survive the decompositions: every value the model ``.detach()``-ed
or computed under ``torch.no_grad()`` reaches its consumers through an
``aten.alias`` node flagged ``meta[STOP_KEY]`` (``trace_joint`` detaches there); a tensor a
``no_grad`` region hands back as itself (a no-op ``.to``) keeps its gradient, as in eager
(``_mark_stop_gradients``).
Under ``torch.autocast`` (``trace_forward(autocast=...)``, ``fxshard/precision.py``) the forward runs inside it
and its casts are ``_to_copy`` nodes; casts to another dtype are never merged (two uses' gradients then sum
in the wider dtype, as eager's do).
No real weight is allocated.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import operator
import os
import inspect
import re
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.nn.functional as F
from torch.export.graph_signature import ConstantArgument, InputKind
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..attention_op import route_exported
from ..constrain import constraint_scope, record
from ..cumulative_bn import cumulative_batch_norm_traceable
from ..custom_grads import custom_gradients_checked
from ..eager_branches import eager_branches
from ..errors import ShardingError
from ..forward_state import forward_state_unchanged, warn_traced_hooks
from ..fake_trace import fake_inputs, functional_make_fx, named_placeholders, reject_effect_tokens
from ..ir import STOP_KEY, source_line
from ..precision import AUTOCAST_DEVICES, AutocastState, autocast_off
from ..trace_by_op import by_op_enabled, forward_by_op
from .simplify import drop_noop_clones
from ..torch_compat import OpOverload, OpOverloadPacket, from_fun, has_data_mutation, has_metadata_mutation, to_fun
from ..torch_compat import FakeTensorMode, ShapeEnv
from ..torch_compat import nn_reduction as _Reduction

aten = torch.ops.aten

__all__ = ["Traced", "Slot", "trace_forward", "source_line", "decomposition_table", "joint_decomposition_table",
           "tracing_errors", "EAGER_DERIVATIVE", "margin_losses_as_eager",
           "FUSED_FORWARD", "FUSED_BACKWARD", "FUSED_GRAD_ARGS", "STOP_KEY"]


@dataclass
class Slot:
    """One placeholder of the traced graph: what feeds it at run time."""

    kind: str  # "param" | "buffer" | "constant" | "input"
    names: list[str]  # FQNs for params/buffers (all aliases of a tied tensor), [] for inputs
    index: int = -1  # position among the flattened user-input tensor leaves
    persistent: bool = True
    requires_grad: bool = False


@dataclass
class Traced:
    """The traced global program and how to feed it."""

    gm: fx.GraphModule
    slots: list[Slot]
    in_tree: Any  # pytree spec of (args, kwargs)
    out_tree: Any
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    n_user_leaves: int = 0
    tensor_leaf_positions: list[int] = field(default_factory=list)
    mutations: list[str] = field(default_factory=list)  # buffers updated in place: the first outputs
    # non-tensor user inputs (floats, ints, bools, strings, None): export specializes the program to
    # their example values, so a call must pass the same values (flat leaf position -> example value)
    constant_leaves: dict[int, Any] = field(default_factory=dict)


DROP = {
    aten._assert_tensor_metadata.default,
    aten._assert_scalar.default,
    aten.sym_constrain_range_for_size.default,
    aten._assert_async.msg,
}


# Fused CPU kernels kept out of the decompositions: each has a sharding rule (fxshard/rules/), and
# decomposing them costs ~25% of a training step in small ops (benchmarks/profile_step.py). fxshard's traces
# route F.scaled_dot_product_attention to fxshard::attention (fxshard/attention_op.py) before any decomposition,
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
    from ..torch_compat import core_aten_decompositions_post_autograd

    return core_aten_decompositions_post_autograd()


def _softmaxes(stop: Any) -> tuple[Any, Any]:
    """``_softmax`` and ``_log_softmax`` decomposed as torch does, except that the row max they subtract
    goes through ``stop`` (a stop-gradient). Softmax is shift invariant, so no gradient flows through
    that max (eager's fused backward has none); differentiating it cost six extra passes over the
    logits in every backward, and collectives when the class dim is split."""
    from ..torch_compat import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes, softmax_unbacked_safe_amax

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
    """While active, ``torch.nn.functional``'s (and ``torch._C._nn``'s) margin losses of ``_ABOVE_AUTOGRAD``
    run its replacements: ``make_fx`` traces of Python functions (``fxshard.jit``) then hold them where
    torch's Autograd-key decomposition would run (export graphs are fixed by ``_replace_above_autograd``).

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
_MARGIN_C = {torch._C._nn.multilabel_margin_loss: (_multilabel_margin_loss, ("input", "target", "reduction")),
             torch._C._nn.multi_margin_loss: (_multi_margin_loss,
                                              ("input", "target", "p", "margin", "weight", "reduction"))}


def _replace_above_autograd(gm: fx.GraphModule) -> None:
    """Point every node of an op in ``_ABOVE_AUTOGRAD`` (in ``gm`` and its subgraphs) at its replacement."""
    for mod in gm.modules():
        if isinstance(mod, fx.GraphModule):
            found = [n for n in mod.graph.nodes if n.op == "call_function" and n.target in _ABOVE_AUTOGRAD]
            for n in found:
                n.target = _ABOVE_AUTOGRAD[n.target]
            if found:  # nearly no model has one: its code is not generated again for nothing
                mod.recompile()


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


@torch.library.custom_op("fxshard::stop_gradient", mutates_args=())
def _stop_gradient(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_stop_gradient.register_fake
def _stop_gradient_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


_stop_gradient.register_autograd(lambda ctx, grad: None)
_STOP = torch.ops.fxshard.stop_gradient.default


# Ops whose result never needs a gradient, whatever their inputs (``_needs_grad``): fresh tensors shaped like one.
_NO_GRADIENT = frozenset({
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
    aten.rand_like.default, aten.randn_like.default, aten.randint_like.default, aten.randint_like.low_dtype,
    aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default,
    aten.detach.default, _STOP,
})


def _mark_stop_gradients(gm: fx.GraphModule) -> None:
    """Route every ``detach`` and every value leaving a ``no_grad`` region (export's
    ``wrap_with_set_grad_enabled(False, ...)``) that eager hands back without a gradient through
    ``fxshard::stop_gradient``, an op the decompositions keep (they turn ``detach`` into ``alias`` and
    inline the regions).

    Which region outputs keep their gradient is what eager does (:func:`_region_in_eager`): an output that
    is one of the region's inputs itself (a no-op ``.to``/``.float()``/``.type_as``, ``requires_grad_()``;
    export then maps every later use of the input to that output) keeps it; views and new tensors made
    under ``no_grad`` do not. A tensor the region writes in place keeps its later value without a gradient
    through the write (``copy_`` of its stop-gradient after the region: eager's write is invisible to
    autograd), unless it needs a gradient itself (``_needs_grad``): eager then differentiates through it
    as if the write had not happened, or fails in backward where the written value was saved; one
    traced program reproduces neither, so that is a ShardingError. A parameter or input written there
    is left to ``trace_forward``'s mutation check."""
    for mod in gm.modules():
        if not isinstance(mod, fx.GraphModule):
            continue
        g = mod.graph
        rg: dict[fx.Node, bool] = {}
        for n in list(g.nodes):
            if n.op == "call_function" and n.target is aten.detach.default:
                if _written_through(n) is None:
                    n.target = _STOP
                else:  # an in-place write to the detached alias is one to its source: keep them one tensor
                    _check_write_through_detach(n)
            elif (n.op == "call_function" and n.target is torch.ops.higher_order.wrap_with_set_grad_enabled
                  and n.args[0] is False):
                _stop_region_outputs(mod, n, rg)
                continue
            rg[n] = _needs_grad(n, rg, mod is gm)
        mod.recompile()


def _needs_grad(n: fx.Node, rg: dict[fx.Node, bool], root: bool) -> bool:
    """Whether ``n`` may need a gradient in eager (never False where eager's does): a floating or complex
    value computed from one that does (``rg``, per node so far), a parameter or input that requires grad;
    a placeholder of a region's graph (``root`` False) may."""
    v = n.meta.get("val")
    if isinstance(v, torch.Tensor) and not (v.is_floating_point() or v.is_complex()):
        return False
    if n.op == "placeholder":
        return not root or bool(getattr(v, "requires_grad", False))
    if n.op != "call_function" or n.target in _NO_GRADIENT:
        return False
    return any(rg.get(a, False) for a in pytree.tree_leaves((n.args, n.kwargs)) if isinstance(a, fx.Node))


def _stop_region_outputs(mod: fx.GraphModule, region: fx.Node, rg: dict[fx.Node, bool]) -> None:
    """Requires: ``region`` a ``wrap_with_set_grad_enabled(False, ...)`` node of ``mod``'s graph, ``rg``
    :func:`_needs_grad` of the nodes before it. Ensures: its outputs without a gradient in eager reach their
    users through ``fxshard::stop_gradient``; a tensor it writes in place is a stop-gradient of its new
    value after it, or a ShardingError when that tensor needs a gradient (see :func:`_mark_stop_gradients`)."""
    g = mod.graph
    ins = list(region.args[2:])
    same: dict[int, int] = {}
    written: set[int] = set()
    grad_out: set[int] = set()
    if any(isinstance(a, fx.Node) and rg.get(a, False) for a in ins):  # else no gradient can leave it
        same, written, grad_out = _region_in_eager(getattr(mod, region.args[1].target), ins)
    after = region
    for i in sorted(written):
        x = ins[i]
        if x.op != "placeholder" and rg.get(x, False):
            raise ShardingError(
                f"forward writes a tensor that needs a gradient (computed at {source_line(x) or x.name}) in place "
                f"under torch.no_grad() ({_first_write(getattr(mod, region.args[1].target), i)}): "
                f"eager's autograd does not see that write (it differentiates as if it had not happened, "
                f"or fails in backward where the old value was saved), which one traced program cannot reproduce; "
                f"compute the new value out-of-place (h = h * 2 instead of h.mul_(2)), under torch.no_grad() "
                f"if it should carry no gradient")
        with g.inserting_after(after):
            stop = g.call_function(_STOP, (x,))
        with g.inserting_after(stop):
            after = g.call_function(aten.copy_.default, (x, stop))
        stop.meta.update(x.meta)
        after.meta.update(x.meta)
    for out in list(region.users):
        k = out.args[1] if out.op == "call_function" and out.target is operator.getitem else None
        if k in grad_out and same.get(k) not in written:
            rg[out] = rg.get(ins[same[k]], False) if k in same else True
            continue
        with g.inserting_after(out):
            stop = g.call_function(_STOP, (out,))
        stop.meta.update(out.meta)
        out.replace_all_uses_with(stop, delete_user_cb=lambda u, stop=stop: u is not stop)
        rg[out] = False


def _region_in_eager(sub: fx.GraphModule, ins: list) -> tuple[dict[int, int], set[int], set[int]]:
    """Runs ``sub`` (a grad-disabled region's graph; ``ins`` its arguments, nodes with fake values) as eager
    would, under ``no_grad`` on fake tensors, every floating input requiring grad. Returns: which outputs
    are an input itself (output index -> input index), which inputs it writes in place (their version
    counter moved), and which outputs carry a gradient (inputs themselves, or made under a nested
    ``enable_grad``; a view made under ``no_grad`` reports ``requires_grad`` but is a leaf: no gradient
    reaches its base through it)."""
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in ins]
    mode = next((v.fake_mode for v in vals if hasattr(v, "fake_mode")), None)
    if mode is None:  # no tensor comes in: every output is made inside
        return {}, set(), set()
    with mode:
        args = [v.detach().requires_grad_(v.is_floating_point() or v.is_complex()) if isinstance(v, torch.Tensor)
                else v for v in vals]
        versions = [a._version if isinstance(a, torch.Tensor) else None for a in args]
        with torch.no_grad():
            outs = sub(*args)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    same = {k: i for k, o in enumerate(outs) for i, a in enumerate(args) if isinstance(o, torch.Tensor) and o is a}
    written = {i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a._version != versions[i]}
    grad_out = set(same) | {k for k, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.grad_fn is not None}
    return same, written, grad_out


def _first_write(sub: fx.GraphModule, i: int) -> str:
    """Where ``sub``'s ``i``-th placeholder is first written in place (for messages)."""
    x = [n for n in sub.graph.nodes if n.op == "placeholder"][i]
    w = _written_through(x)
    return f"{w.target} at {source_line(w) or 'an unknown line'}" if w is not None else "a write"


def _written_through(node: fx.Node) -> Optional[fx.Node]:
    """The first op that writes ``node``'s storage in place, directly or through views of it, or None."""
    todo, seen = [node], {node}
    while todo:
        x = todo.pop()
        for u in x.users:
            if u.op != "call_function" or not isinstance(u.target, OpOverload):
                continue
            schema = u.target._schema
            given = dict(zip((a.name for a in schema.arguments), u.args)) | dict(u.kwargs)
            for a in schema.arguments:
                if given.get(a.name) is not x or a.alias_info is None:
                    continue
                if a.alias_info.is_write:
                    return u
                if u not in seen and any(r.alias_info is not None and r.alias_info.before_set
                                         & a.alias_info.before_set for r in schema.returns):
                    seen.add(u)  # a view of it
                    todo.append(u)
    return None


def _check_write_through_detach(node: fx.Node) -> None:
    """Requires: an op writes ``node`` (a ``detach``) in place. Ensures: ShardingError unless its source is a
    graph input (a parameter, buffer or input: the write is then traced as that input's update, which
    ``trace_forward`` accepts for buffers and refuses for the others)."""
    if node.args[0].op == "placeholder":
        return
    writer = _written_through(node)
    raise ShardingError(
        f"forward writes a detached tensor in place ({writer.target} at {source_line(writer) or 'an unknown line'}): "
        f"in eager that changes the value it was detached from without recording it for autograd, which one "
        f"traced program cannot reproduce; compute a new tensor (out-of-place) instead")


def _decomposed(gm: fx.GraphModule, table: dict) -> tuple[fx.GraphModule, list[int]]:
    """``gm`` (an exported program's graph) re-traced by ``make_fx`` with ``table`` over functional fake
    tensors, and the positions of the placeholders it updates in place: the graph
    ``ExportedProgram.run_decompositions(table)`` gives (same placeholders and names, core ATen, nodes
    keep their source lines; each updated placeholder's new value an output, in placeholder order,
    before ``gm``'s outputs), at about half its cost (it traces the program twice and collects every
    CompositeImplicitAutograd op per call). Where it can, one distinct op at a time
    (``fxshard/trace_by_op.py``; the same graph)."""
    with _recurrent_per_step(gm):
        return _decomposed_here(gm, table)


_RECURRENT = (aten.lstm.input, aten.lstm.data)


def _recurrent_per_step(gm: fx.GraphModule) -> Any:
    """oneDNN off while ``gm``'s LSTMs are decomposed: torch's decomposition picks ``mkldnn_rnn_layer`` for an
    LSTM on CPU whose input needs no gradient, as in the forward trace; that kernel has no sharding rule,
    and its backward needs a workspace the traced forward does not keep (an LSTM's backward failed with a
    bare RuntimeError). Without it the decomposition is per time step, every op has a rule, and the
    backward is derived like any other's."""
    if any(n.op == "call_function" and n.target in _RECURRENT for m in gm.modules() if isinstance(m, fx.GraphModule)
           for n in m.graph.nodes):
        return torch.backends.mkldnn.flags(enabled=False)
    return contextlib.nullcontext()


def _decomposed_here(gm: fx.GraphModule, table: dict) -> tuple[fx.GraphModule, list[int]]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    vals = [n.meta.get("val") for n in placeholders]
    inputs, _, tracing_mode = fake_inputs(vals)
    if tracing_mode == "fake" and by_op_enabled():
        fast = forward_by_op(gm, table)  # the same graph, each distinct op traced once
        if fast is not None:
            return fast, []
    interp = fx.Interpreter(gm)
    mutated: list[int] = []

    def forward(*args: Any) -> tuple:
        # as run_decompositions traces: inputs that require grad do here too, under no_grad; composites
        # pick their kernels by both (embedding_bag's forward-only kernel has no backward; attention keeps
        # its fused kernel, which the joint trace decomposes where its backward falls short)
        funs = [to_fun(a).requires_grad_() if isinstance(a, torch.Tensor) and v.requires_grad else to_fun(a)
                for a, v in zip(args, vals)]
        with fx_traceback.preserve_node_meta():
            outs = interp.run(*funs)
        for i, f in enumerate(funs):
            if isinstance(f, torch.Tensor) and has_metadata_mutation(f, args[i], check_only_storage_mutation=False):
                raise ShardingError(f"forward changes the shape or strides of its input {placeholders[i].name!r} "
                                    f"in place; compute a new tensor and return it instead")
        mutated[:] = [i for i, f in enumerate(funs) if isinstance(f, torch.Tensor) and has_data_mutation(f)]
        return tuple([from_fun(funs[i]) for i in mutated] + [from_fun(o) if isinstance(o, torch.Tensor) else o
                                                             for o in outs])

    with torch.no_grad():
        out = functional_make_fx(forward, inputs, tracing_mode, table)
    reject_effect_tokens(out, "the forward", "the error check (the _ex variant: torch.linalg.inv_ex for inv)")
    return named_placeholders(out, [n.name for n in placeholders]), mutated


def _flag_stop_gradients(gm: fx.GraphModule) -> None:
    """The markers become ``aten.alias`` nodes flagged ``meta[STOP_KEY]`` (see module doc)."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is _STOP:
            n.target = aten.alias.default
            n.meta[STOP_KEY] = True
    gm.recompile()


class _RandomOps:
    """The op packets CSE must keep apart: any overload tagged ``nondeterministic_seeded``."""

    def __contains__(self, packet: Any) -> bool:
        return isinstance(packet, OpOverloadPacket) and any(
            torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads())


def _cse(gm: fx.GraphModule, keep_casts: bool = False) -> fx.GraphModule:
    """Merge identical pure nodes (export repeats views per consumer), keeping node metadata.

    ``keep_casts``: casts to another dtype (``_to_copy`` with ``dtype``) stay apart, for a graph autograd has
    not run over yet: eager casts twice where the code does (autocast casts each use of a value except a
    parameter it caches), and the gradients of two casts sum in the wider dtype, those of one in the narrower.

    Requires a functional graph: two equal nodes of a graph that mutates could hold different values
    by the time they are read, so a graph with any in-place op is returned unchanged.
    Ensures what torch's ``CSEPass`` does (same keys: target and flattened arguments; the first of
    equal nodes kept; random ops never merged), in place: ``CSEPass`` builds an eagerly compiled
    GraphModule, whose Python codegen is most of its cost on a large graph.
    """
    from ..torch_compat import get_graph_module_cls as _get_graph_module_cls

    if any(isinstance(n.target, OpOverload) and n.target._schema.is_mutable for n in gm.graph.nodes):
        return gm
    random = _RandomOps()  # two draws are two draws: never merge random ops
    seen: dict[Any, list[tuple[Any, fx.Node]]] = {}
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or getattr(n.target, "overloadpacket", n.target) in random:
            continue
        if keep_casts and n.target is aten._to_copy.default and "dtype" in n.kwargs:
            continue
        # earlier merges already rewrote n's arguments to the kept nodes
        args, args_spec = pytree.tree_flatten(n.args)
        kwargs, kwargs_spec = pytree.tree_flatten(n.kwargs)
        same = seen.setdefault((n.target, tuple(args), tuple(kwargs)), [])
        first = next((m for specs, m in same if specs == (args_spec, kwargs_spec)), None)  # specs: unhashable
        if first is None:
            same.append(((args_spec, kwargs_spec), n))
        else:
            n.replace_all_uses_with(first)
            gm.graph.erase_node(n)
    cls = _get_graph_module_cls()  # lazy while shard() runs: later passes' recompiles only mark the code stale
    out = gm if isinstance(gm, cls) else cls(gm, gm.graph)
    out.recompile()
    return out


def _user_frame(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    for fr in reversed(frames):
        if f"{os.sep}torch{os.sep}" not in fr.filename and f"{os.sep}fxshard{os.sep}" not in fr.filename:
            return f"{fr.filename}:{fr.lineno} ({fr.line})"
    return "unknown location"


_DATA_DEPENDENT = ("GuardOnDataDependentSymNode", "DataDependentOutputException", "DynamicOutputShapeException")


def tracing_error(what: str, e: BaseException, fix: str, where: Optional[str] = None) -> ShardingError:
    """One readable error for a failed trace: what was traced, the cause, the user's line (``where``, else
    the innermost user frame of ``e``), the fix. Raise it ``from None``: torch's own traceback and graph
    dumps say nothing the message does not (``__context__`` keeps them for debugging)."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if type(e).__name__ in _DATA_DEPENDENT:
        fix = ("a size or a Python branch there depends on tensor values, which one traced program for all "
               "inputs cannot express; use torch.where for value-dependent choices (torch.where(cond, a, b) "
               "instead of `if`, torch.where(mask, x, 0) instead of x[mask]), Python ints for sizes and split "
               "points, or run that part outside the sharded module")
    return ShardingError(f"could not trace {what}: {type(e).__name__}: {msg} [at {where or _user_frame(e)}]; {fix}")


Lazy = Union[str, Callable[[], Optional[str]]]


@contextlib.contextmanager
def tracing_errors(what: Lazy, fix: str, where: Optional[Lazy] = None) -> Iterator[None]:
    """Turn any exception the block raises (torch's tracing exceptions, a RuntimeError from an op)
    into :func:`tracing_error`; a ShardingError passes through unchanged. ``what`` and ``where``
    may be callables, read when the trace fails (e.g. the node being traced then)."""
    try:
        yield
    except ShardingError:
        raise
    except Exception as e:  # noqa: BLE001 - any tracing failure becomes one readable error
        what_s = what() if callable(what) else what
        where_s = where() if callable(where) else where
        raise tracing_error(what_s, e, fix, where_s) from None


@contextlib.contextmanager
def quiet_unless_ok() -> Iterator[None]:
    """Hold back what tracing prints to ``sys.stderr`` and logs through torch's loggers (torch prints a
    failing graph's code once per nested GraphModule): replayed when the block succeeds, dropped when it
    raises (the ShardingError says what matters)."""
    buf = io.StringIO()
    held: list[logging.LogRecord] = []
    loggers = [logging.getLogger(n) for n in list(logging.Logger.manager.loggerDict) if n.split(".")[0] == "torch"]
    handlers = list({id(h): h for lg in loggers for h in lg.handlers}.values())

    def hold(record: logging.LogRecord) -> bool:
        held.append(record)
        return False

    for h in handlers:
        h.addFilter(hold)
    try:
        with contextlib.redirect_stderr(buf):
            yield
    finally:
        for h in handlers:
            h.removeFilter(hold)
    sys.stderr.write(buf.getvalue())
    for record in held:
        logging.getLogger(record.name).handle(record)


def _distinct(args: Any, kwargs: Any) -> tuple[Any, Any]:
    """Example inputs where no tensor object appears twice: export traces one tensor passed twice as one
    input (the program then reads the last of those arguments in place of both), while the sharded
    module takes them as separate arguments."""
    seen: set[int] = set()

    def once(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) in seen:
            return x.detach().clone().requires_grad_(x.requires_grad)
        seen.add(id(x))
        return x

    return pytree.tree_map(once, args), pytree.tree_map(once, kwargs)


def _on_device(args: Any, kwargs: Any, device: torch.device) -> tuple[Any, Any]:
    """Example inputs on ``device``: real tensors are moved (meta ones to a meta model), meta tensors for a
    real model become fake tensors on the model's device (export traces them; nothing is allocated)."""
    leaves = pytree.tree_leaves((args, kwargs))
    if device.type != "meta" and any(isinstance(x, torch.Tensor) and x.device.type == "meta" for x in leaves):

        mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())

        def fake(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            with mode:
                t = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)
            return t.requires_grad_(x.requires_grad) if x.is_floating_point() else t

        return pytree.tree_map(fake, args), pytree.tree_map(fake, kwargs)
    if device.type == "meta":
        move = lambda x: x.to(device) if isinstance(x, torch.Tensor) and x.device != device else x  # noqa: E731
        return pytree.tree_map(move, args), pytree.tree_map(move, kwargs)
    return args, kwargs


@contextlib.contextmanager
def _boundary_hooks(model: torch.nn.Module, boundaries: Optional[dict]) -> Iterator[None]:
    """Record the plan's module-boundary constraints as ``fxshard::constrain`` ops while tracing."""
    handles = []
    modules = dict(model.named_modules(remove_duplicate=False))
    for fqn, bounds in (boundaries or {}).items():
        def pre(mod, args, kwargs, bounds=bounds):
            args = list(args)
            for b in bounds:
                for i, spec in enumerate(b.inputs[: len(args)]):
                    args[i] = record(args[i], spec)
                for k, spec in b.kwargs.items():
                    if k in kwargs:
                        kwargs[k] = record(kwargs[k], spec)
            return tuple(args), kwargs

        def post(mod, args, kwargs, out, bounds=bounds):
            for b in bounds:
                if isinstance(out, (tuple, list)):
                    out = type(out)(record(o, s) for o, s in zip(out, list(b.outputs) + [None] * len(out)))
                elif b.outputs:
                    out = record(out, b.outputs[0])
            return out

        m = modules[fqn]
        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True))
    try:
        with constraint_scope():
            yield
    finally:
        for h in handles:
            h.remove()


def _mutation_error(model: torch.nn.Module, spec: Any) -> ShardingError:
    """Why the forward may not update the input or parameter of ``spec`` in place, and what to do instead."""
    name = spec.target or spec.arg.name
    head = f"forward mutates {name!r} ({spec.kind.name}_MUTATION)"
    if spec.kind != InputKind.PARAMETER:
        return ShardingError(f"{head}; in-place updates of inputs are not supported: compute the new value and "
                             f"return it instead")
    fqn = name.rpartition(".")[0]
    owner = model.get_submodule(fqn)
    why = ""
    if isinstance(owner, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and owner.max_norm is not None:
        why = (f" ({type(owner).__name__} {fqn!r} has max_norm={owner.max_norm}: its forward renormalizes the rows it "
               f"looks up in place; set max_norm=None, or scale the rows in the forward out-of-place)")
    return ShardingError(
        f"{head}{why}; a sharded program does not update parameters while it runs (each rank holds pieces, and "
        f"the optimizer updates them): change the parameter outside the forward, e.g. under torch.no_grad() after "
        f"optimizer.step(), or compute the changed value as a new tensor in the forward")


_UNKNOWN_OUTPUT = re.compile(r"Found <class '([\w.]+)'> in output, which is not a known type")


def _unknown_output_error(model: torch.nn.Module, kwargs: dict, e: BaseException) -> Optional[ShardingError]:
    """The ShardingError for a forward that returns an object torch.export cannot flatten (``e`` is export's
    error), or None when ``e`` is another error. A Hugging Face model returning its key/value cache
    (``DynamicCache``, because ``config.use_cache`` is on) is told to pass ``use_cache=False``."""
    m = _UNKNOWN_OUTPUT.search(str(e))
    if m is None:
        return None
    cls = m.group(1)
    short = cls.rpartition(".")[2]
    config = getattr(model, "config", None)
    if "cache" in short.lower() and getattr(config, "use_cache", None) and kwargs.get("use_cache") is not False:
        return ShardingError(
            f"{type(model).__name__}'s forward returns a {short} (its key/value cache for generation, returned "
            f"because config.use_cache is True), which cannot be an output of a sharded program; for training "
            f"and one-pass inference pass use_cache=False in example_kwargs and in every call, or set "
            f"model.config.use_cache = False before fxshard.shard()")
    return ShardingError(
        f"{type(model).__name__}'s forward returns a {cls} object, which torch.export cannot take apart into "
        f"tensors; return tensors (or tuples, lists, dicts or dataclasses of them), or register {short} as a "
        f"pytree node (torch.utils._pytree.register_pytree_node) so its tensors can be outputs")


def _export_decomposed(model: torch.nn.Module, args: Any, kwargs: Any, dynamic_shapes: Any,
                       boundaries: Optional[dict], autocast: Optional[AutocastState]
                       ) -> tuple[Any, fx.GraphModule, list[int]]:
    """Export's program of ``model(*args, **kwargs)`` (inside ``autocast`` when given) and its decomposed
    graph with the placeholders it updates (``_decomposed``)."""
    off = autocast_off(autocast.device_type) if autocast is not None else contextlib.nullcontext()
    with tracing_errors(f"{type(model).__name__} with torch.export (non-strict)",
                        "make forward traceable (no data-dependent Python control flow, no .item()/.tolist() on "
                        "tensors) or pass example_inputs matching forward's signature"), quiet_unless_ok(), off:
        warn_traced_hooks(model)
        with _forward_inside(model, autocast), _NoGradReadsRefused(), cumulative_batch_norm_traceable(model), \
                _boundary_hooks(model, boundaries), custom_gradients_checked(model), \
                forward_state_unchanged(model) as state, eager_branches():
            try:
                ep = torch.export.export(model, tuple(args), kwargs or None, dynamic_shapes=dynamic_shapes,
                                         strict=False)
            except RuntimeError as e:
                raise _unknown_output_error(model, kwargs, e) or e
        state.check_constants(ep.constants)
        _mark_stop_gradients(ep.graph_module)
        _replace_above_autograd(ep.graph_module)
        route_exported(ep.graph_module)  # attention: one device-neutral node (fxshard/attention_op.py)
        gm, mutated = _decomposed(ep.graph_module, decomposition_table(lambda t: _STOP(t)))
    return ep, gm, mutated


_DETACHING = {torch.Tensor.detach, torch.detach}


class _NoGradReadsRefused(TorchFunctionMode):
    """While a forward is exported: a ``torch.no_grad()`` region inside an enabled ``torch.autocast`` (shard()'s,
    or the model's own) that computes from a tensor needing a gradient raises a ShardingError. ``torch.export``
    keeps no grad-disabled region nested inside an autocast region (its passes inline it), so such a region's
    gradient would silently flow where eager's stops (``_mark_stop_gradients`` finds nothing to mark). Regions
    over tensors that need no gradient (rotary tables from buffers and positions) lose nothing and pass;
    ``.detach()`` is an op, kept in the graph."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch.is_grad_enabled() or func in _DETACHING:
            return out
        active = [AutocastState.current(d) for d in AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]
        if (active and any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(out))
                and any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves((args, kwargs)))):
            raise ShardingError(
                f"{_caller_line()} computes under torch.no_grad() from a tensor that needs a gradient, inside "
                f"{active[0]}; torch.export drops a grad-disabled region nested in an autocast forward, so "
                f"the gradient would flow through it unlike eager's. Compute that value from .detach()-ed "
                f"tensors instead (e.g. self.proj(h.detach()) in place of the no_grad block), or shard and call "
                f"the module without autocast")
        return out


def _caller_line() -> str:
    """The innermost frame of the running stack outside torch and fxshard, as ``file:line (code)``."""
    for fr in reversed(traceback.extract_stack()):
        if f"{os.sep}torch{os.sep}" not in fr.filename and f"{os.sep}fxshard{os.sep}" not in fr.filename:
            return f"{fr.filename}:{fr.lineno} ({fr.line})"
    return "the forward"


@contextlib.contextmanager
def _forward_inside(model: torch.nn.Module, autocast: Optional[AutocastState]) -> Iterator[None]:
    """``model.forward`` runs inside ``autocast`` in the block (an instance attribute wrapping it, with its
    signature: export reads argument names from it); nothing changes without one."""
    if autocast is None:
        yield
        return
    own = model.__dict__.get("forward")
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with autocast.context():
            return inner(*args, **kwargs)

    model.__dict__["forward"] = forward
    try:
        yield
    finally:
        if own is None:
            del model.__dict__["forward"]
        else:
            model.__dict__["forward"] = own


@contextlib.contextmanager
def _traced_on(model: torch.nn.Module, args: Any, kwargs: Any, autocast: Optional[AutocastState]
               ) -> Iterator[tuple[Any, Any]]:
    """The example inputs to trace with, the model's parameters and buffers swapped for fake tensors on
    ``autocast``'s device type in the block when any of them or of the inputs lives elsewhere (a meta model:
    autocast casts nothing on the meta device), inputs made fake tensors of the same mode. Without
    ``autocast``, or when every tensor is on its device type already, nothing changes."""
    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    tensors = list(model.parameters()) + list(model.buffers())
    if autocast is None or all(t.device.type == autocast.device_type for t in tensors + leaves):
        yield args, kwargs
        return

    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    device = torch.device(autocast.device_type)
    memo: dict[int, torch.Tensor] = {}

    def fake(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in memo:
            with mode:
                t = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)
            if isinstance(x, torch.nn.Parameter):
                t = torch.nn.Parameter(t, requires_grad=x.requires_grad)
            elif x.requires_grad:
                t.requires_grad_(True)
            memo[id(x)] = t
        return memo[id(x)]

    swapped = []
    for m in model.modules():
        for table in (m._parameters, m._buffers):
            for name, t in list(table.items()):
                if t is not None:
                    swapped.append((table, name, t))
                    table[name] = fake(t)
    try:
        yield pytree.tree_map(fake, args), pytree.tree_map(fake, kwargs)
    finally:
        for table, name, t in swapped:
            table[name] = t


def trace_forward(model: torch.nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any = None,
                  boundaries: Optional[dict] = None, autocast: Optional[AutocastState] = None) -> Traced:
    """Export ``model(*args, **kwargs)`` to a decomposed core-ATen graph (see module doc).

    ``boundaries`` (module FQN -> style Boundaries) become ``fxshard::constrain`` ops at those
    modules' inputs and outputs; ``fxshard.constrain`` calls in model code are recorded too.
    ``autocast``: the forward runs inside it (``precision.py``), so the graph holds autocast's casts as
    ``_to_copy`` nodes; every tensor is then traced on that device type (autocast casts nothing on meta).
    """
    if not isinstance(model, torch.nn.Module):
        raise ShardingError(f"shard() expects an nn.Module, got {type(model).__name__}; wrap your function in a Module")
    tensors = list(model.parameters()) + list(model.buffers())
    args, kwargs = _distinct(args, kwargs)
    with _traced_on(model, args, kwargs, autocast) as (args, kwargs):
        if autocast is None:
            args, kwargs = _on_device(args, kwargs, tensors[0].device if tensors else torch.device("cpu"))
        ep, gm, mutated = _export_decomposed(model, args, kwargs, dynamic_shapes, boundaries, autocast)

    sig = ep.graph_signature
    by_id: dict[int, list[str]] = {}
    tensor_of: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
        tensor_of[name] = p
    for name, b in model.named_buffers(remove_duplicate=False):
        by_id.setdefault(id(b), []).append(name)
        tensor_of[name] = b
    non_persistent = set(sig.non_persistent_buffers) if hasattr(sig, "non_persistent_buffers") else set()

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    slots: list[Slot] = []
    first_of: dict[int, fx.Node] = {}
    keep: list[fx.Node] = []
    user_i = 0
    for node, spec in zip(placeholders, sig.input_specs):
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            t = tensor_of[spec.target]
            if id(t) in first_of:  # tied: reuse the first placeholder of the same tensor
                node.replace_all_uses_with(first_of[id(t)])
                gm.graph.erase_node(node)
                continue
            first_of[id(t)] = node
            kind = "param" if spec.kind == InputKind.PARAMETER else "buffer"
            slots.append(
                Slot(kind, list(by_id[id(t)]), persistent=spec.target not in non_persistent,
                     requires_grad=bool(getattr(t, "requires_grad", False)) and kind == "param")
            )
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            slots.append(Slot("constant", [spec.target]))
        elif spec.kind == InputKind.USER_INPUT and isinstance(spec.arg, ConstantArgument):
            if node.users:
                raise ShardingError(f"forward's non-tensor argument {node.name!r} is used as a graph input; "
                                    f"pass it as a tensor")
            gm.graph.erase_node(node)
            continue
        elif spec.kind == InputKind.USER_INPUT:
            slots.append(Slot("input", [], index=user_i))
            user_i += 1
        else:
            raise ShardingError(f"unsupported exported input kind {spec.kind} for {node.name}")
        keep.append(node)

    mutations: list[str] = []
    for i in mutated:
        spec = sig.input_specs[i]
        if spec.kind == InputKind.BUFFER:
            mutations.append(spec.target)
        else:
            raise _mutation_error(model, spec)

    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in DROP:
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm = drop_noop_clones(_cse(gm, keep_casts=True))
    _flag_stop_gradients(gm)

    flat, in_tree = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    constant_leaves = {i: x for i, x in enumerate(flat) if not isinstance(x, torch.Tensor)}
    if len(positions) != user_i:
        raise ShardingError(
            f"the exported program takes {user_i} tensor inputs but the example inputs hold {len(positions)} tensors; "
            f"pass tensors for every tensor argument of forward"
        )
    return Traced(
        gm=gm,
        slots=slots,
        in_tree=in_tree,
        out_tree=ep.call_spec.out_spec,
        constants=dict(ep.constants),
        n_user_leaves=len(flat),
        mutations=mutations,
        tensor_leaf_positions=positions,
        constant_leaves=constant_leaves,
    )
