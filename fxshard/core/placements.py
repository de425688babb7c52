"""Placement types: how one tensor is laid out over one mesh axis.

Users speak torch's ``Shard`` / ``Replicate`` / ``Partial`` or a JAX-style
``P(...)`` PartitionSpec; internally every placement is one of three small
immutable values that print short:

* ``R``            replicated;
* ``S(d)``         dim ``d`` split into equal contiguous chunks, rank ``i`` holds
  chunk ``i``; ``S(d, outer=k)`` views dim ``d`` as ``[k, size/k]`` and splits
  the second factor (the layout a merged ``[batch*heads]`` dim has when heads
  are sharded, and a packed ``[gate; up]`` weight needs): rank ``i`` holds the
  ``i``-th chunk of each of the ``k`` blocks, in block order. It is torch's
  ``_StridedShard(d, split_factor=k)`` on a single mesh axis, and ``Packed``
  in a ``P(...)`` spec;
* ``Part(op)``     every rank holds a term; the value is their reduction by
  ``op`` (``sum``, ``max`` or ``min``). Printed ``P(sum)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, Union

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from .errors import ShardingError
from .torch_compat import StridedShard as _StridedShard

__all__ = ["R", "S", "Part", "Pl", "Replicated", "P", "Packed", "from_torch", "to_torch"]

if not (Partial.__doc__ or "").strip():  # torch's Partial has none; fxshard re-exports it (help(fxshard.Partial))
    try:
        Partial.__doc__ = (
            "torch's Partial placement: each rank holds a term of the value, which is the reduction (``reduce_op``, "
            "default 'sum') of the terms over the mesh axis. In fxshard: an input or output declared Partial('sum') "
            "in in_specs/out_specs (each rank passes or gets a term; its gradient is whole on every rank), and the "
            "P(sum)/P(max) state propagation gives values that linear ops keep partial until a reduction is needed.")
    except (AttributeError, TypeError):  # a torch whose class does not take a docstring: help() shows none
        pass


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
    if isinstance(p, _StridedShard):
        d = p.dim + ndim if p.dim < 0 and ndim is not None else p.dim
        return S(d, int(p.split_factor))
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
    """Convert an internal placement to torch's (a strided shard is ``_StridedShard``, see module doc)."""
    if isinstance(p, S):
        return Shard(p.dim) if p.outer == 1 else _StridedShard(p.dim, split_factor=p.outer)
    if isinstance(p, Part):
        return Partial(p.op)
    return Replicate()


@dataclass(frozen=True)
class Packed:
    """A ``P(...)`` entry for a dim holding ``blocks`` equal packed blocks, each split over mesh axis ``axis``.

    A fused projection stores several matrices along one dim (``[gate; up]`` is 2 blocks, ``[q; k; v]``
    of equal widths 3): ``P(Packed("tp", 2), None)`` gives every rank its chunk of each block (rank ``i``
    holds ``gate[i]`` and ``up[i]``), so the blocks stay aligned after the split. This is the internal
    ``S(d, outer=blocks)`` and torch's ``_StridedShard(d, split_factor=blocks)``; the dim must divide by
    ``blocks`` times the axis size.
    """

    axis: str
    blocks: int

    def __post_init__(self) -> None:
        if not isinstance(self.axis, str) or not isinstance(self.blocks, int) or self.blocks < 1:
            raise ShardingError(
                f"Packed({self.axis!r}, {self.blocks!r}): give one mesh axis name and a positive block count, "
                f"e.g. Packed('tp', 2) for a fused [gate; up] dim"
            )

    def __repr__(self) -> str:
        return f"Packed({self.axis!r}, {self.blocks})"


class P(tuple):
    """JAX-style PartitionSpec: one entry per tensor dim.

    Each entry is ``None`` (not split), a mesh axis name, a tuple of names
    (split over several axes, major first), or ``Packed(axis, blocks)`` (a dim of
    packed blocks, each split over ``axis``). ``P("tp", None)`` splits dim 0 over
    axis ``tp``. Fewer entries than the tensor has dims leave the rest unsplit.
    """

    def __new__(cls, *entries: Union[None, str, Sequence[str], Packed]) -> "P":
        norm: list = []
        for e in entries:
            if e is None or isinstance(e, (str, Packed)):
                norm.append(e)
            elif isinstance(e, (tuple, list)) and all(isinstance(a, str) for a in e):
                norm.append(tuple(e) if len(e) != 1 else e[0])
            else:
                raise ShardingError(
                    f"P entry {e!r} is neither None, a mesh axis name, a tuple of names nor Packed(axis, blocks); "
                    f"write e.g. P('tp', None), P(('dp', 'tp'), None) or P(Packed('tp', 2), None)"
                )
        return super().__new__(cls, norm)

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self) + ")"

    def __getnewargs__(self) -> tuple:
        return tuple(self)  # pickle and copy call P(*entries), not P(entries)

    def axes_of(self, dim: int) -> tuple[str, ...]:
        """The mesh axes that split tensor dim ``dim`` (empty when unsplit)."""
        if dim >= len(self) or self[dim] is None:
            return ()
        e = self[dim]
        if isinstance(e, Packed):
            return (e.axis,)
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
            axes = self.axes_of(d)
            known = [a for a in axes if a in axis_names]
            in_mesh_order = sorted(known, key=list(axis_names).index)
            if known != in_mesh_order:
                raise ShardingError(
                    f"{what}: {self!r} splits dim {d} over {tuple(known)}, {known[0]!r} major, but a dim split over "
                    f"several axes is laid out major-first in mesh order {tuple(axis_names)}; write "
                    f"{tuple(in_mesh_order)!r} (the pieces differ) or a mesh with the axes in that order"
                )
            for a in axes:
                if a not in axis_names:
                    raise ShardingError(
                        f"{what}: {self!r} names mesh axis {a!r}, but the mesh axes are "
                        f"{tuple(axis_names)}; use one of those names"
                    )
                if a in seen:
                    raise ShardingError(f"{what}: {self!r} uses mesh axis {a!r} twice; use each axis once")
                seen.add(a)
                out[list(axis_names).index(a)] = S(d, self[d].blocks if isinstance(self[d], Packed) else 1)
        return tuple(out)

    @staticmethod
    def from_placements(placements: Sequence[Pl], axis_names: Sequence[str], ndim: int) -> "P":
        """The PartitionSpec of per-axis placements (Partial has none; a strided split is ``Packed``)."""
        dims: list[list[str]] = [[] for _ in range(ndim)]
        packed: dict[int, int] = {}
        for a, p in zip(axis_names, placements):
            p = from_torch(p, ndim)
            if isinstance(p, Part):
                raise ShardingError(f"{p!r} on axis {a!r} has no PartitionSpec form")
            if isinstance(p, S):
                dims[p.dim].append(a)
                if p.outer != 1:
                    packed[p.dim] = p.outer
        out: list = []
        for i, d in enumerate(dims):
            if i in packed and len(d) != 1:
                raise ShardingError(f"dim {i} is packed and split over axes {d}; a packed dim takes one axis")
            out.append(Packed(d[0], packed[i]) if i in packed else None if not d else d[0] if len(d) == 1 else tuple(d))
        return P(*out)
