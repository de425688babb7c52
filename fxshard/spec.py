"""``Spec``: a tensor's placements over every mesh axis plus its global shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .placements import Part, Pl, R, S
from .symbolic import Dim, divides, exact_div, prod

__all__ = ["Spec", "META_KEY", "fmt_placements", "shard_factor", "local_shape"]

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


def local_shape(shape: Sequence[Dim], pls: Sequence[Pl], sizes: Sequence[int]) -> tuple[Dim, ...]:
    """Per-rank shape; requires every split dim to be divisible (checked at propagation)."""
    return tuple(exact_div(s, shard_factor(pls, sizes, d)) for d, s in enumerate(shape))


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

    def local_shape(self, sizes: Sequence[int]) -> tuple[Dim, ...]:
        return local_shape(self.shape, self.placements, sizes)

    def local_bytes(self, sizes: Sequence[int]) -> Dim:
        return prod(self.local_shape(sizes)) * self.dtype.itemsize

    def is_replicated(self) -> bool:
        return all(p == R for p in self.placements)

    def has_partial(self) -> bool:
        return any(isinstance(p, Part) for p in self.placements)

    def divisible(self, sizes: Sequence[int]) -> bool:
        for d, s in enumerate(self.shape):
            f = shard_factor(self.placements, sizes, d)
            if f > 1 and not divides(s, f):
                return False
        return True
