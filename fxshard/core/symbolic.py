"""Shape arithmetic that works the same for concrete ints and sympy expressions."""

from __future__ import annotations

import math
from typing import Any, Iterable, Union

import sympy
import torch

Dim = Union[int, sympy.Expr]

__all__ = ["Dim", "sym_dim", "sym_shape", "prod", "divides", "exact_div", "equal", "is_concrete"]


def sym_dim(s: Any) -> Dim:
    """An int, or the sympy expression of a ``torch.SymInt``."""
    if isinstance(s, torch.SymInt):
        e = s.node.expr
        return int(e) if e.is_Integer else e
    return int(s)


def sym_shape(t: Any) -> tuple[Dim, ...]:
    """Shape of a (fake) tensor as ints, with sympy expressions for symbolic dims."""
    return tuple(sym_dim(s) for s in t.shape)


def is_concrete(d: Dim) -> bool:
    return isinstance(d, int) or (isinstance(d, sympy.Expr) and d.is_Integer)


def prod(xs: Iterable[Dim]) -> Dim:
    out: Dim = 1
    for x in xs:
        out = out * x
    return int(out) if is_concrete(out) else sympy.expand(out)


def _as_dim(x: Any) -> Any:
    """A graph node standing for a SymInt (a size the data decides) as its sympy symbol."""
    val = getattr(x, "meta", {}).get("val") if hasattr(x, "meta") else None
    return sym_dim(val) if isinstance(val, (int, torch.SymInt)) else x


def equal(a: Dim, b: Dim) -> bool:
    a, b = _as_dim(a), _as_dim(b)
    if is_concrete(a) and is_concrete(b):
        return int(a) == int(b)
    return sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0


def divides(n: Dim, d: Dim) -> bool:
    """True when ``d`` divides ``n`` for every value of the symbols in them.

    A symbolic ``n`` counts as divisible only when sympy can prove it (e.g.
    ``4*s0`` by 2), so an unprovable case is reported as not divisible.
    """
    if is_concrete(n) and is_concrete(d):
        return int(d) != 0 and int(n) % int(d) == 0
    q = sympy.cancel(sympy.sympify(n) / sympy.sympify(d))
    num, den = sympy.fraction(q)
    if not den.is_Integer:
        return False
    # every coefficient of the polynomial numerator must be divisible by the denominator
    poly = sympy.Poly(num, *sorted(num.free_symbols, key=str)) if num.free_symbols else None
    coeffs = poly.coeffs() if poly is not None else [num]
    return all(sympy.Integer(c) % den == 0 for c in coeffs if c.is_Integer) and all(c.is_Integer for c in coeffs)


def exact_div(n: Dim, d: Dim) -> Dim:
    """``n / d`` for a ``d`` already known to divide ``n``."""
    if is_concrete(n) and is_concrete(d):
        return int(n) // int(d)
    q = sympy.cancel(sympy.sympify(n) / sympy.sympify(d))
    return int(q) if q.is_Integer else q


def ceil_div(n: int, d: int) -> int:
    return -(-n // d)


def gcd(a: int, b: int) -> int:
    return math.gcd(a, b)
