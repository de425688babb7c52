"""Elementwise ops with broadcasting, as one table.

Each op has a kind that says which Partial states it preserves:

* ``copy``     the value passes through unchanged: any Partial is kept;
* ``linear``   sums of terms map to sums of results (add, sub, neg, ...): ``P(sum)`` kept when every
  tensor input is ``P(sum)``;
* ``mul``      linear in each tensor argument separately: one ``P(sum)`` input, the rest replicated;
* ``div``      linear in the numerator only;
* ``grad``     an activation's backward ``f_backward(grad_out, x)``: linear in ``grad_out`` only;
* ``where``    linear in the two value arguments with a non-partial condition;
* ``nonlinear`` only split or replicated inputs.

Every kind also admits all-replicated and every split along an output dim
that all non-broadcast inputs share.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

from ..core.placements import Part, Pl, R, S
from .registry import OpCall, Strategy, all_r, register, split_outers
from ..core.spec import can_split
from ..core.symbolic import Dim, equal

aten = torch.ops.aten

COPY = ("clone", "alias", "_to_copy", "detach", "lift_fresh_copy", "contiguous")
LINEAR = ("add.Tensor", "sub.Tensor", "neg", "mul.Scalar", "div.Scalar", "where.self", "_conj", "_conj_physical")
MUL = ("mul.Tensor",)
DIV = ("div.Tensor",)
GRAD = ("gelu_backward", "silu_backward", "threshold_backward", "sigmoid_backward", "tanh_backward")
NONLINEAR = (
    "add.Scalar sub.Scalar rsub.Scalar rsub.Tensor pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar rsqrt sqrt exp "
    "exp2 expm1 log log1p log2 sigmoid tanh relu gelu silu sin cos abs sign reciprocal erf erfinv "
    "maximum minimum clamp.default clamp.Tensor clamp_min.default clamp_max.default eq.Scalar eq.Tensor ne.Scalar "
    "ne.Tensor lt.Scalar lt.Tensor le.Scalar le.Tensor gt.Scalar gt.Tensor ge.Scalar ge.Tensor logical_and "
    "logical_or logical_not logical_xor bitwise_and.Tensor bitwise_or.Tensor bitwise_not bitwise_xor.Tensor "
    "isnan isinf floor ceil round.default trunc fmod.Scalar fmod.Tensor remainder.Scalar remainder.Tensor "
    "floor_divide.default atan2.default hardtanh leaky_relu elu celu mish hardsigmoid hardswish softplus sinc "
    "masked_fill.Scalar masked_fill.Tensor "
    "acos acosh asin asinh atan atanh cosh sinh tan log10 erfc digamma lgamma polygamma i0 signbit angle "
    "copysign.Tensor fmax fmin hypot nextafter igamma igammac ldexp.Tensor div.Tensor_mode round.decimals "
    "frexp.Tensor polar complex "
    "special_log_ndtr special_i0e special_i1 special_i1e special_ndtri special_erfcx special_zeta special_airy_ai "
    "special_bessel_j0 special_bessel_j1 special_bessel_y0 special_bessel_y1 special_modified_bessel_i0 "
    "special_modified_bessel_i1 special_modified_bessel_k0 special_modified_bessel_k1 "
    "special_scaled_modified_bessel_k0 special_scaled_modified_bessel_k1 special_spherical_bessel_j0 "
    "special_chebyshev_polynomial_t special_chebyshev_polynomial_u special_chebyshev_polynomial_v "
    "special_chebyshev_polynomial_w special_shifted_chebyshev_polynomial_t special_shifted_chebyshev_polynomial_u "
    "special_shifted_chebyshev_polynomial_v special_shifted_chebyshev_polynomial_w special_hermite_polynomial_h "
    "special_hermite_polynomial_he special_laguerre_polynomial_l special_legendre_polynomial_p"
).split()


def _overloads(names: Iterable[str]) -> list:
    ops = []
    for name in names:
        base, _, ov = name.partition(".")
        packet = getattr(aten, base)
        ops.append(getattr(packet, ov or "default"))
    return ops


def dim_map(in_shape: Sequence[Dim], out_shape: Sequence[Dim]) -> list[Optional[int]]:
    """For each output dim, the input dim it reads (None where the input broadcasts)."""
    off = len(out_shape) - len(in_shape)
    res: list[Optional[int]] = []
    for d in range(len(out_shape)):
        j = d - off
        if j < 0 or (equal(in_shape[j], 1) and not equal(out_shape[d], 1)):
            res.append(None)
        else:
            res.append(j)
    return res


def split_strategies(call: OpCall, n: int, out_shape: Sequence[Dim], in_idx: Sequence[int]) -> list[Strategy]:
    """Strategies splitting one output dim, for inputs ``in_idx`` broadcasting to ``out_shape``.

    Inputs not in ``in_idx`` are replicated (e.g. a condition mask handled by the caller).
    """
    maps = {i: dim_map(call.in_shapes[i], out_shape) for i in in_idx}
    res = []
    for d, size in enumerate(out_shape):
        for o in split_outers((p, m[d]) for m, p in zip(maps.values(), call.in_pls)):
            if not can_split(size, n, o):
                continue
            ins: list[Pl] = [R] * len(call.in_shapes)
            for i in in_idx:
                j = maps[i][d]
                ins[i] = S(j, o) if j is not None else R
            res.append(Strategy(tuple(ins), S(d, o)))
    return res


def broadcast_placement(out_pl: Pl, in_shape: Sequence[Dim], out_shape: Sequence[Dim]) -> Pl:
    """The placement an input broadcasting into an output with ``out_pl`` must have."""
    if isinstance(out_pl, S):
        j = dim_map(in_shape, out_shape)[out_pl.dim]
        return S(j, out_pl.outer) if j is not None else R
    return out_pl


def _partials_kept_by_copy(call: OpCall) -> tuple[str, ...]:
    """The Partial kinds a copy keeps. A dtype cast (``_to_copy``) keeps ``P(sum)`` only into a floating
    dtype or between integer dtypes (``int(a) + int(b) != int(a + b)``), and ``P(max)``/``P(min)`` only
    into an ordered non-bool dtype (casts are monotonic, but ``bool`` is not)."""
    val = call.node.meta.get("val")
    if call.node.target is not aten._to_copy.default or not call.in_dtypes or not isinstance(val, torch.Tensor):
        return ("sum", "max", "min")
    src, dst = call.in_dtypes[0], val.dtype
    if src == dst:
        return ("sum", "max", "min")
    kept: tuple[str, ...] = ()
    if dst.is_floating_point or dst.is_complex or (not src.is_floating_point and not src.is_complex
                                                   and src != torch.bool and dst != torch.bool):
        kept += ("sum",)
    if dst != torch.bool and not dst.is_complex and not src.is_complex:
        kept += ("max", "min")
    return kept


def pointwise_rule(kind: str):
    def rule(call: OpCall, n: int) -> list[Strategy]:
        k = len(call.in_shapes)
        out_shape = call.out_shape
        if out_shape and isinstance(out_shape[0], tuple):  # several outputs of one shape (frexp)
            return [Strategy(st.inputs, (st.output,) * len(out_shape)) for st in rule(_first_output(call), n)]
        strategies = [Strategy(all_r(k), R)]
        strategies += split_strategies(call, n, out_shape, range(k))
        if kind == "copy":
            for op in _partials_kept_by_copy(call):
                strategies.append(Strategy(tuple(Part(op) for _ in range(k)), Part(op)))
        elif kind == "linear" and k:
            if call.node.target is aten.where.self:
                strategies.append(Strategy((R,) + (Part(),) * (k - 1), Part()))
            elif k == 2 or call.node.target not in (aten.add.Tensor, aten.sub.Tensor):
                # a lone tensor in add/sub means a scalar operand: x + c is affine, not linear
                strategies.append(Strategy(tuple(Part() for _ in range(k)), Part()))
        elif kind in ("mul", "div", "grad"):
            for i in range(k if kind == "mul" else 1):
                ins = [R] * k
                ins[i] = Part()
                strategies.append(Strategy(tuple(ins), Part()))
        return strategies

    rule.__name__ = f"pointwise_{kind}"
    return rule


def _first_output(call: OpCall) -> OpCall:
    return OpCall(call.node, call.in_shapes, call.in_pls, call.out_shape[0], call.in_dtypes)


for _kind, _names in (("copy", COPY), ("linear", LINEAR), ("mul", MUL), ("div", DIV), ("grad", GRAD),
                      ("nonlinear", NONLINEAR)):
    register(_overloads(_names), pointwise_rule(_kind))
