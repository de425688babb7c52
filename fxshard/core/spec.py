"""``Spec``: a tensor's placements over every mesh axis plus its global shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .placements import Part, Pl, R, S
from .symbolic import Dim, ceil_div, divides, exact_div, is_concrete, prod

__all__ = ["Spec", "fmt_placements", "shard_factor", "local_shape", "chunk", "can_split",
           "split_ok", "local_outer", "is_uneven", "chunk_index"]


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
    be cut unevenly (see :func:`can_split`). A dim split over several axes must divide evenly. A strided
    split ``S(d, k)`` may share its dim only with plain splits that cut whole blocks (their product
    divides ``k``): the ``[B*H]`` merge of attention with ``B`` on ``dp`` and ``H`` on ``tp``; each rank
    holds the intersection of the pieces (see :func:`local_outer`)."""
    split = [(p, n) for p, n in zip(pls, sizes) if isinstance(p, S)]
    if not split:  # the common case, on the hot path of propagation
        return True
    if any(p.dim >= len(shape) for p, _ in split):
        return False
    for d in {p.dim for p, _ in split}:  # a dim no axis splits always passes
        size = shape[d]
        on_d = [(p, n) for p, n in split if p.dim == d and n > 1]
        strided = [(p, n) for p, n in on_d if p.outer > 1]
        if len(strided) > 1:
            return False
        if strided:
            (sp, sn), = strided
            plain = prod(n for p, n in on_d if p.outer == 1)
            if sp.outer % plain or not divides(size, sp.outer * sn):
                return False
            continue
        f = prod(n for _, n in on_d)
        if f == 1 or divides(size, f):
            continue
        if not (uneven and len(on_d) == 1 and can_split(size, f)):
            return False
    return True


def local_outer(pls: Sequence[Pl], sizes: Sequence[int], a: int) -> Pl:
    """Axis ``a``'s placement as seen on this rank's piece: a strided split ``S(d, k)`` whose dim other
    axes also split (plainly, whole blocks, :func:`split_ok`) has ``k / their product`` blocks locally;
    collectives and slices work on local pieces, so they take this form."""
    p = pls[a]
    if not isinstance(p, S) or p.outer == 1:
        return p
    f = prod(n for i, (q, n) in enumerate(zip(pls, sizes)) if i != a and isinstance(q, S) and q.dim == p.dim)
    return S(p.dim, p.outer // f)


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
