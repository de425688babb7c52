"""Attention as one device-neutral node: the custom ops ``fxshard::attention`` and ``fxshard::attention_backward``.

``torch.export`` keeps ``F.scaled_dot_product_attention`` as one ``aten.scaled_dot_product_attention`` node,
but decomposing it (fxshard's ``make_fx`` re-traces) picks the kernel of the fake tensors' device: on CPU
``_scaled_dot_product_flash_attention_for_cpu`` (a CPU-only kernel, also in programs traced on the meta
device), on CUDA cuDNN / memory-efficient kernels whose output layouts differ from each other. fxshard's
traces therefore route attention to ``fxshard::attention`` (:func:`route_exported` for export's graphs,
:class:`attention_as_one_op` while ``fxshard.jit`` traces a function), whose kernel is chosen when the
program runs (``F.scaled_dot_product_attention``'s own choice on the device the tensors are on).

* ``fxshard::attention(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False) -> out``:
  ``out`` is always contiguous ``[..., L, Ev]`` (no program depends on the layout a kernel returns); where
  export recorded another stride order for the attention it replaces, the program restores it after the op
  (``_keep_traced_layout``, through ``core/layout.py``'s ``pin``), so the views export kept stay valid.
* ``fxshard::attention_backward(grad, q, k, v, attn_mask, is_causal, scale, enable_gqa, mask_grad) ->
  [grad_q, grad_k, grad_v(, grad_mask)]``: recomputes the forward and differentiates it (one extra
  attention forward per call): on CPU, where eager picks the fused kernel, that kernel's forward and
  backward; elsewhere ``torch.func.vjp`` of ``F.scaled_dot_product_attention``, which works for every kernel
  and device and materialises no more than the kernel does. Each gradient is contiguous, in its input's
  shape; ``grad_mask`` (only with ``mask_grad``) is the learned mask's gradient.
* Attention is not a random op: the ops carry no ``nondeterministic_seeded`` tag. Attention with
  ``dropout_p > 0`` is not routed here: it is traced as torch's math form (``_scaled_dot_product_attention_math``,
  decomposed into matmuls, softmax and a dropout whose mask is drawn per rank like any other dropout), as
  is attention traced while the user allows only the math backend (``sdpa_kernel(SDPBackend.MATH)``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode

from ..core.layout import memory_order, pin
from ..core.precision import AUTOCAST_DEVICES

aten = torch.ops.aten

__all__ = ["ATTENTION", "ATTENTION_BACKWARD", "attention", "route_exported", "attention_as_one_op",
           "fused_backends_enabled"]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor], is_causal: bool,
          scale: Optional[float], enable_gqa: bool) -> torch.Tensor:
    kw: dict[str, Any] = {"scale": scale}
    if enable_gqa:  # only passed when set: the keyword is newer than some torch versions' F.sdpa
        kw["enable_gqa"] = True
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal, **kw)


@torch.library.custom_op("fxshard::attention", mutates_args=())
def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
               is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False) -> torch.Tensor:
    return _sdpa(query, key, value, attn_mask, is_causal, scale, enable_gqa).contiguous()


@_attention.register_fake
def _attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False, scale: Optional[float] = None,
                    enable_gqa: bool = False) -> torch.Tensor:
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


@torch.library.custom_op("fxshard::attention_backward", mutates_args=())
def _attention_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_mask: Optional[torch.Tensor], is_causal: bool, scale: Optional[float], enable_gqa: bool,
                        mask_grad: bool) -> list[torch.Tensor]:
    if _cpu_flash(query, key, value, attn_mask, is_causal, scale, enable_gqa, mask_grad):
        # what eager's backward runs: the CPU kernel's own backward, on the recomputed output and logsumexp
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal,
                                                                     attn_mask=attn_mask, scale=scale)
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, query, key, value, out, lse, 0.0,
                                                                         is_causal, attn_mask=attn_mask, scale=scale)
        return [g.contiguous() for g in grads]
    # torch.func.vjp: autograd is off inside an op's kernel (the dispatcher runs it below autograd)
    if mask_grad and attn_mask is not None:
        _, vjp = torch.func.vjp(lambda q, k, v, m: _sdpa(q, k, v, m, is_causal, scale, enable_gqa),
                                query, key, value, attn_mask)
    else:
        _, vjp = torch.func.vjp(lambda q, k, v: _sdpa(q, k, v, attn_mask, is_causal, scale, enable_gqa),
                                query, key, value)
    grads = vjp(grad.contiguous())  # fused kernels' backwards want a dense grad (a .sum()'s grad has stride 0)
    return [g.contiguous() for g in grads]


def _cpu_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], is_causal: bool,
               scale: Optional[float], enable_gqa: bool, mask_grad: bool) -> bool:
    """Whether eager runs this attention on CPU's fused kernel, whose backward then serves directly (no mask
    gradient, no GQA: the kernel's backward has neither; a boolean mask, which eager converts first, takes the
    general path)."""
    return (q.device.type == "cpu" and not mask_grad and not enable_gqa and q.dim() == 4
            and (mask is None or mask.dtype == q.dtype)
            and aten._fused_sdp_choice(q, k, v, mask, 0.0, is_causal, scale=scale) == _FLASH)


_FLASH = int(SDPBackend.FLASH_ATTENTION)


@_attention_backward.register_fake
def _attention_backward_fake(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attn_mask: Optional[torch.Tensor], is_causal: bool, scale: Optional[float],
                             enable_gqa: bool, mask_grad: bool) -> list[torch.Tensor]:
    outs = [query, key, value] + ([attn_mask] if mask_grad and attn_mask is not None else [])
    return [t.new_empty(t.shape) for t in outs]


def _setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
    q, k, v, mask, is_causal, scale, enable_gqa = inputs
    ctx.save_for_backward(q, k, v, mask)
    ctx.attrs = (is_causal, scale, enable_gqa)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    q, k, v, mask = ctx.saved_tensors
    mask_grad = mask is not None and ctx.needs_input_grad[3]
    with torch.no_grad():  # no double backward; and torch.func's transforms refuse the op's own autograd wrapper
        grads = ATTENTION_BACKWARD(grad, q, k, v, mask, *ctx.attrs, mask_grad)
    return (grads[0], grads[1], grads[2], grads[3] if mask_grad else None, None, None, None)


_attention.register_autograd(_backward, setup_context=_setup_context)


def _autocast_kernel(device_type: str) -> Any:
    """``fxshard::attention``'s kernel under ``torch.autocast(device_type)``: autocast's policy for
    ``scaled_dot_product_attention`` (a lower-precision op): every floating input but float64 is cast to the
    autocast dtype, then the op runs with autocast off. Without it a traced autocast forward would hand the
    op its inputs uncast (e.g. rotary-embedded q/k in float32 beside a bfloat16 v), unlike eager."""

    def kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
               is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False) -> torch.Tensor:
        cast = _autocast_cast(torch.get_autocast_dtype(device_type))
        with torch.autocast(device_type, enabled=False):
            return ATTENTION(cast(query), cast(key), cast(value), cast(attn_mask), is_causal, scale, enable_gqa)

    return kernel


def _autocast_cast(dtype: torch.dtype) -> Any:
    """Autocast's cast for a lower-precision op: floating tensors but float64 to ``dtype``, others (None, bool
    masks) as they are."""

    def cast(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        eligible = t is not None and t.is_floating_point() and t.dtype != torch.float64
        return t.to(dtype) if eligible else t

    return cast


_AUTOCAST = torch.library.Library("fxshard", "IMPL")
for _device_type in AUTOCAST_DEVICES:
    _AUTOCAST.impl("attention", _autocast_kernel(_device_type), f"Autocast{_device_type.upper()}")

ATTENTION = torch.ops.fxshard.attention.default
ATTENTION_BACKWARD = torch.ops.fxshard.attention_backward.default
_MATH = aten._scaled_dot_product_attention_math.default


class _Attention(torch.autograd.Function):
    """``fxshard::attention`` with its backward, for ``torch.func`` transforms (``fxshard.jit``'s functions take
    gradients with ``torch.func.grad``, which a custom op's registered autograd does not serve)."""

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], is_causal: bool,
                scale: Optional[float], enable_gqa: bool) -> torch.Tensor:
        return ATTENTION(q, k, v, mask, is_causal, scale, enable_gqa)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        _setup_context(ctx, inputs, output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _backward(ctx, grad)


def fused_backends_enabled() -> bool:
    """Whether some fused SDPA backend is allowed (False inside ``sdpa_kernel(SDPBackend.MATH)``)."""
    return (torch.backends.cuda.flash_sdp_enabled() or torch.backends.cuda.mem_efficient_sdp_enabled()
            or torch.backends.cuda.cudnn_sdp_enabled())


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
              enable_gqa: bool = False, _apply: Any = ATTENTION) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` as fxshard traces it (see module doc): ``fxshard::attention``
    unless ``dropout_p`` is not 0 or only the math backend is enabled, then torch's math form. ``_apply``
    calls the op (``_Attention.apply`` where ``torch.func`` transforms may differentiate it)."""
    if (not isinstance(dropout_p, (int, float)) or dropout_p != 0.0) or not fused_backends_enabled():
        return math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return _apply(query, key, value, attn_mask, bool(is_causal), scale, bool(enable_gqa))


def math_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor],
                   dropout_p: float, is_causal: bool, scale: Optional[float] = None,
                   enable_gqa: bool = False) -> torch.Tensor:
    """torch's math form of SDPA (``aten._scaled_dot_product_attention_math``, decomposed by the re-traces), with
    autocast's casts for SDPA applied first when autocast is on for the inputs' device (autocast has no policy
    for the math op itself, so mixed-dtype inputs would reach it)."""
    device_type = query.device.type
    kw: dict[str, Any] = {"scale": scale}
    if enable_gqa:
        kw["enable_gqa"] = True
    if device_type in AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type):
        cast = _autocast_cast(torch.get_autocast_dtype(device_type))
        with torch.autocast(device_type, enabled=False):
            return _MATH(cast(query), cast(key), cast(value), cast(attn_mask), dropout_p, is_causal, **kw)[0]
    return _MATH(query, key, value, attn_mask, dropout_p, is_causal, **kw)[0]


_SDPA = aten.scaled_dot_product_attention.default
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _shaped_like_query(n: fx.Node, a: dict) -> bool:
    """Whether export's attention node ``n`` (arguments ``a``) returns ``query``'s shape with ``value``'s last
    dim, the shape ``fxshard::attention`` gives; a query whose batch dims broadcast against the keys' (a learned
    ``[1, H, L, E]`` query) is left to the math form. Unknown shapes count as like the query."""
    out, q, v = n.meta.get("val"), a["query"].meta.get("val"), a["value"].meta.get("val")
    if out is None or q is None or v is None:
        return True
    return tuple(out.shape) == (*q.shape[:-1], v.shape[-1])


def route_exported(gm: fx.GraphModule) -> None:
    """Point every ``aten.scaled_dot_product_attention`` node of ``gm`` and its subgraphs at :func:`attention`'s
    choice: ``fxshard::attention`` (an op the re-traces keep), or torch's math form (decomposed by them)."""
    for mod in gm.modules():
        if not isinstance(mod, fx.GraphModule):
            continue
        found = [n for n in mod.graph.nodes if n.op == "call_function" and n.target is _SDPA]
        for n in found:
            a = {**{"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False},
                 **dict(zip(_SDPA_ARGS, n.args)), **n.kwargs}
            p = a["dropout_p"]
            if isinstance(p, (int, float)) and p == 0.0 and fused_backends_enabled() and _shaped_like_query(n, a):
                n.target = ATTENTION
                n.args = (a["query"], a["key"], a["value"], a["attn_mask"], a["is_causal"], a["scale"],
                          a["enable_gqa"])
                n.kwargs = {}
                _keep_traced_layout(mod.graph, n)
            else:  # the math form, decomposed by the re-traces
                n.target = math_attention
                n.args = (a["query"], a["key"], a["value"], a["attn_mask"], p, a["is_causal"], a["scale"],
                          a["enable_gqa"])
                n.kwargs = {}
        if found:
            mod.recompile()


def _keep_traced_layout(graph: fx.Graph, n: fx.Node) -> None:
    """Requires: ``n`` was export's attention node, now ``fxshard::attention`` (contiguous output). Ensures: its
    users read a value in the stride order export recorded for it (``meta["val"]``), which the views export kept
    after it were valid for: export drops a ``.contiguous()`` that was a no-op for the kernel it traced with
    (torch 2.11's CPU kernel returns ``[B, H, L, E]`` laid out as ``[B, L, H, E]``, so
    ``out.transpose(1, 2).contiguous().view(B, L, -1)`` became a bare ``view``). ``layout.pin`` restores it,
    the same on every device and kernel."""
    val = n.meta.get("val")
    order = memory_order(val) if isinstance(val, torch.Tensor) else None
    if order is not None:
        pin(graph, n, order)


class attention_as_one_op(TorchFunctionMode):
    """While active, ``F.scaled_dot_product_attention`` runs :func:`attention` (``fxshard.jit``'s trace)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func is F.scaled_dot_product_attention:
            return attention(*args, **(kwargs or {}), _apply=_Attention.apply)
        return func(*args, **(kwargs or {}))
