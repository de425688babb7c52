"""``Spec``: a tensor's placements over every mesh axis plus its global shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .placements import Part, Pl, R, S
from .symbolic import Dim, ceil_div, divides, exact_div, is_concrete, prod

__all__ = ["Spec", "META_KEY", "fmt_placements", "shard_factor", "local_shape", "chunk", "can_split",
           "split_ok", "is_uneven", "chunk_index"]

META_KEY = "fxshard_spec"


def fmt_placements(pls: Sequence[Pl]) -> str:
    """``S(0)`` for a 1-D mesh, ``[S(0), R]`` for more axes."""
    return repr(pls[0]) if len(pls) == 1 else "[" + ", ".join(map(repr, pls)) + "]"


def shard_factor(pls: Sequence[Pl], sizes: Sequence[int], dim: int) -> int:
    """How many pieces tensor dim ``dim`` is split into over the whole mesh."""
    f = 1
    for p, n in zip(pls, sizes):
        if isinstance(p, S) and p.dim == dim:
            f *= n
    return f


def chunk(size: int, n: int, i: int) -> tuple[int, int]:
    """(start, length) of piece ``i`` of ``size`` elements cut into ``n`` pieces as ``torch.chunk`` does:
    every piece holds ``ceil(size / n)`` elements except the last non-empty one."""
    c = ceil_div(size, n)
    start = min(i * c, size)
    return start, min(c, size - start)


def can_split(size: Dim, n: int, outer: int = 1) -> bool:
    """Whether a dim of ``size`` may be split ``n`` ways (``outer``: strided split).

    Even splits always may. An uneven split (``torch.chunk`` semantics) needs a concrete size, a plain
    split, and a non-empty piece on every rank (``(n - 1) * ceil(size / n) < size``), so reductions
    and collectives never meet an empty shard. Symbolic sizes must provably divide.
    """
    if divides(size, outer * n):
        return True
    return outer == 1 and is_concrete(size) and n > 1 and (n - 1) * ceil_div(int(size), n) < int(size)


def is_uneven(size: Dim, f: int) -> bool:
    return f > 1 and not divides(size, f)


def chunk_index(pls: Sequence[Pl], sizes: Sequence[int], coords: Sequence[int], dim: int) -> int:
    """This rank's piece index along tensor dim ``dim`` (axes split it major first)."""
    idx = 0
    for p, n, c in zip(pls, sizes, coords):
        if isinstance(p, S) and p.dim == dim:
            idx = idx * n + c
    return idx


def split_ok(shape: Sequence[Dim], pls: Sequence[Pl], sizes: Sequence[int], uneven: bool = False) -> bool:
    """Every split dim exists and divides; with ``uneven``, a dim split over ONE mesh axis may instead
    be cut unevenly (see :func:`can_split`). A dim split over several axes must divide evenly, and a
    strided split may not share its dim with another axis (collectives treat its outer factor as global)."""
    split = [p for p in pls if isinstance(p, S)]
    if not split:  # the common case, on the hot path of propagation
        return True
    for p in split:
        if p.dim >= len(shape) or (p.outer > 1 and sum(1 for q in split if q.dim == p.dim) > 1):
            return False
    for d in {p.dim for p in split}:  # a dim no axis splits always passes
        size = shape[d]
        axes = [n for p, n in zip(pls, sizes) if isinstance(p, S) and p.dim == d and n > 1]
        f = prod(axes)
        outer = max([p.outer for p in split if p.dim == d], default=1)
        if f == 1 or divides(size, f * outer):
            continue
        if outer > 1:
            return False
        if not (uneven and len(axes) == 1 and can_split(size, f)):
            return False
    return True


def local_shape(shape: Sequence[Dim], pls: Sequence[Pl], sizes: Sequence[int],
                coords: Optional[Sequence[int]] = None) -> tuple[Dim, ...]:
    """Per-rank shape. An unevenly split dim has this rank's ``torch.chunk`` length when ``coords``
    (this rank's mesh coordinates) is given, else the largest piece (for estimates)."""
    out = []
    for d, s in enumerate(shape):
        f = shard_factor(pls, sizes, d)
        if not is_uneven(s, f):
            out.append(exact_div(s, f))
        elif coords is None:
            out.append(ceil_div(int(s), f))
        else:
            out.append(chunk(int(s), f, chunk_index(pls, sizes, coords, d))[1])
    return tuple(out)


@dataclass(frozen=True)
class Spec:
    """Placements (one per mesh axis) and the global shape/dtype of one tensor value."""

    placements: tuple[Pl, ...]
    shape: tuple[Dim, ...]
    dtype: torch.dtype

    def __repr__(self) -> str:
        return fmt_placements(self.placements)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def with_placements(self, pls: Sequence[Pl]) -> "Spec":
        return Spec(tuple(pls), self.shape, self.dtype)

    def local_shape(self, sizes: Sequence[int], coords: Optional[Sequence[int]] = None) -> tuple[Dim, ...]:
        return local_shape(self.shape, self.placements, sizes, coords)

    def local_bytes(self, sizes: Sequence[int]) -> Dim:
        return prod(self.local_shape(sizes)) * self.dtype.itemsize

    def is_replicated(self) -> bool:
        return all(p == R for p in self.placements)

    def has_partial(self) -> bool:
        return any(isinstance(p, Part) for p in self.placements)
