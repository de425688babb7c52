"""Placement types: how one tensor is laid out over one mesh axis.

Users speak torch's ``Shard`` / ``Replicate`` / ``Partial`` or a JAX-style
``P(...)`` PartitionSpec; internally every placement is one of three small
immutable values that print short:

* ``R``            replicated;
* ``S(d)``         dim ``d`` split into equal contiguous chunks, rank ``i`` holds
  chunk ``i``; ``S(d, outer=k)`` views dim ``d`` as ``[k, size/k]`` and splits
  the second factor (the layout a merged ``[batch*heads]`` dim has when heads
  are sharded);
* ``Part(op)``     every rank holds a term; the value is their reduction by
  ``op`` (``sum``, ``max`` or ``min``). Printed ``P(sum)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, Union

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from .errors import ShardingError

__all__ = ["R", "S", "Part", "Pl", "Replicated", "P", "from_torch", "to_torch"]


@dataclass(frozen=True)
class Replicated:
    """Every rank holds the whole tensor."""

    def __repr__(self) -> str:
        return "R"


R = Replicated()


@dataclass(frozen=True)
class S:
    """Split along ``dim`` (non-negative); ``outer`` > 1 means strided (see module doc)."""

    dim: int
    outer: int = 1

    def __repr__(self) -> str:
        return f"S({self.dim})" if self.outer == 1 else f"S({self.dim},o{self.outer})"


@dataclass(frozen=True)
class Part:
    """Pending reduction: the true value is ``op`` over the ranks' terms."""

    op: str = "sum"

    def __repr__(self) -> str:
        return f"P({self.op})"


Pl = Union[Replicated, S, Part]
_TORCH_REDUCE = {"sum": "sum", "max": "max", "min": "min", "avg": "avg"}


def from_torch(p: Any, ndim: int | None = None) -> Pl:
    """Convert a torch placement (or an internal one) to an internal placement.

    Requires a ``Shard``/``Replicate``/``Partial`` instance; negative shard dims
    are normalized when ``ndim`` is given.
    """
    if isinstance(p, (Replicated, S, Part)):
        return p
    if isinstance(p, Shard):
        d = p.dim
        if d < 0 and ndim is not None:
            d += ndim
        return S(d)
    if isinstance(p, Replicate):
        return R
    if isinstance(p, Partial):
        op = str(p.reduce_op)
        if op not in ("sum", "max", "min"):
            raise ShardingError(
                f"Partial({op!r}) is not supported; use Partial('sum'), Partial('max') or Partial('min')"
            )
        return Part(op)
    raise ShardingError(
        f"{p!r} is not a placement; use Shard(d), Replicate(), Partial() or a P(...) spec"
    )


def to_torch(p: Pl) -> Placement:
    """Convert an internal placement to torch's (strided shards have no public torch twin)."""
    if isinstance(p, S):
        if p.outer != 1:
            raise ShardingError(f"{p!r} is a strided shard and has no torch placement")
        return Shard(p.dim)
    if isinstance(p, Part):
        return Partial(p.op)
    return Replicate()


class P(tuple):
    """JAX-style PartitionSpec: one entry per tensor dim.

    Each entry is ``None`` (not split), a mesh axis name, or a tuple of names
    (split over several axes, major first). ``P("tp", None)`` splits dim 0 over
    axis ``tp``. Fewer entries than the tensor has dims leave the rest unsplit.
    """

    def __new__(cls, *entries: Union[None, str, Sequence[str]]) -> "P":
        norm = []
        for e in entries:
            if e is None or isinstance(e, str):
                norm.append(e)
            elif isinstance(e, (tuple, list)) and all(isinstance(a, str) for a in e):
                norm.append(tuple(e) if len(e) != 1 else e[0])
            else:
                raise ShardingError(
                    f"P entry {e!r} is neither None, a mesh axis name nor a tuple of names; "
                    f"write e.g. P('tp', None) or P(('dp', 'tp'), None)"
                )
        return super().__new__(cls, norm)

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self) + ")"

    def axes_of(self, dim: int) -> tuple[str, ...]:
        """The mesh axes that split tensor dim ``dim`` (empty when unsplit)."""
        if dim >= len(self) or self[dim] is None:
            return ()
        e = self[dim]
        return (e,) if isinstance(e, str) else tuple(e)

    def to_placements(self, axis_names: Sequence[str], ndim: int, what: str = "spec") -> tuple[Pl, ...]:
        """Per-mesh-axis placements for a tensor of rank ``ndim``.

        Raises ShardingError for unknown axes, an axis used twice, or more
        entries than the tensor has dims; ``what`` names the tensor in messages.
        """
        if len(self) > ndim:
            raise ShardingError(
                f"{what}: {self!r} has {len(self)} entries but the tensor has {ndim} dims; "
                f"give at most {ndim} entries"
            )
        out: list[Pl] = [R] * len(axis_names)
        seen: set[str] = set()
        for d in range(len(self)):
            for a in self.axes_of(d):
                if a not in axis_names:
                    raise ShardingError(
                        f"{what}: {self!r} names mesh axis {a!r}, but the mesh axes are "
                        f"{tuple(axis_names)}; use one of those names"
                    )
                if a in seen:
                    raise ShardingError(f"{what}: {self!r} uses mesh axis {a!r} twice; use each axis once")
                seen.add(a)
                out[list(axis_names).index(a)] = S(d)
        return tuple(out)

    @staticmethod
    def from_placements(placements: Sequence[Pl], axis_names: Sequence[str], ndim: int) -> "P":
        """The PartitionSpec of per-axis placements (Partial and strided have none)."""
        dims: list[list[str]] = [[] for _ in range(ndim)]
        for a, p in zip(axis_names, placements):
            p = from_torch(p, ndim)
            if isinstance(p, Part) or (isinstance(p, S) and p.outer != 1):
                raise ShardingError(f"{p!r} on axis {a!r} has no PartitionSpec form")
            if isinstance(p, S):
                dims[p.dim].append(a)
        return P(*[None if not d else (d[0] if len(d) == 1 else tuple(d)) for d in dims])
