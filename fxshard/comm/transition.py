"""The one transition planner: which steps turn one layout into another, and what each moves.

``plan_transition(src, dst, shape, mesh, dtype)`` is read by both sides of a layout change:
``collectives.redistribute_nodes`` emits exactly these steps as graph nodes, and
``cost.transition_cost`` prices them, so the bytes propagation weighs are the bytes of the
collectives the program gets (``tests/test_transition.py`` checks that on a table of layouts).

Order: reductions, gathers and moves between dims run innermost mesh axis first; local slices
(outermost first) and R->Partial follow. A dim split over several axes holds mesh-major pieces
(rank ``(i, j)`` of a 2x2 mesh has piece ``2i + j``), so an axis gains or loses its split of a dim
only while no inner axis splits that dim: such inner splits are gathered first and sliced again
afterwards (``tests/test_transition.py`` runs every 2x2 change on 4 ranks). Moving a split between
dims on one axis is one all_to_all when the sizes are static and even.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch

from ..core.placements import Part, Pl, R, S
from ..core.spec import is_uneven, local_outer, local_shape
from ..core.symbolic import Dim, ceil_div, is_concrete, prod

__all__ = ["Step", "plan_transition", "COLLECTIVE_KINDS", "WIDEN", "REDUCED_IN_WIDER", "hint", "reduce_scale"]

# dtypes neither gloo nor NCCL reduce or gather: moved as the wider type (exact for sums modulo 2**16,
# max, min and plain moves alike)
WIDEN = {torch.int16: torch.int32}

COLLECTIVE_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


class MeshLike(Protocol):
    sizes: tuple[int, ...]
    coords: tuple[int, ...]


def hint(d: Dim) -> int:
    """A concrete stand-in for a size: symbols count as 64 (for byte estimates only)."""
    if is_concrete(d):
        return int(d)
    return int(d.subs({s: 64 for s in d.free_symbols}))


@dataclass(frozen=True)
class Step:
    """One step of a layout change on one mesh axis.

    ``kind``: a collective (``COLLECTIVE_KINDS``), ``"slice"`` (keep this rank's piece),
    ``"to_partial"`` (R -> Partial: zeros on all but coordinate 0 for sums) or ``"cast"`` (to
    ``dtype``, around the steps of a dtype collectives cannot move). ``lshape`` is the local shape
    before the step; ``nbytes`` the bytes one rank's collective buffer holds (the larger of its
    input and output), for local steps the bytes of the local input. ``gsize`` is the size of the
    gathered dim after an all_gather.
    """

    kind: str
    axis: int = -1
    src: Optional[Pl] = None
    dst: Optional[Pl] = None
    lshape: tuple = ()
    nbytes: int = 0
    gsize: Optional[Dim] = None
    dtype: Optional[torch.dtype] = None

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVE_KINDS


def _can_all_to_all(s: Pl, d: Pl, a: int, cur: Sequence[Pl], lshape: Sequence[Dim], gshape: Sequence[Dim],
                    n: int) -> bool:
    if not (isinstance(s, S) and isinstance(d, S) and s.outer == 1 and d.outer == 1 and s.dim != d.dim):
        return False
    others = [p for i, p in enumerate(cur) if i != a and isinstance(p, S) and p.dim in (s.dim, d.dim)]
    return (not others and all(is_concrete(x) for x in lshape)
            and not is_uneven(gshape[s.dim], n) and not is_uneven(gshape[d.dim], n))


def _communicates(src: Sequence[Pl], dst: Sequence[Pl], sizes: Sequence[int]) -> bool:
    return any(s != d and n > 1 and s != R for s, d, n in zip(src, dst, sizes))


REDUCED_IN_WIDER = ("sum", "avg")  # the Partial ops whose reductions run in ``MeshInfo.reduce_dtype``


def reduce_scale(dtype: torch.dtype, reduce_dtype: Optional[torch.dtype]) -> float:
    """How many times its own bytes a reduction of a Partial sum of ``dtype`` moves when sums are reduced in
    ``reduce_dtype`` (1.0 unless ``dtype`` is a narrower float)."""
    if reduce_dtype is None or not dtype.is_floating_point or dtype.itemsize >= reduce_dtype.itemsize:
        return 1.0
    return reduce_dtype.itemsize / dtype.itemsize


def _reduce_in(src: Sequence[Pl], dst: Sequence[Pl], sizes: Sequence[int], dtype: torch.dtype,
               reduce_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
    """``reduce_dtype`` when the change reduces a Partial sum (or average) of a float narrower than it, else None."""
    if reduce_scale(dtype, reduce_dtype) == 1.0:
        return None
    reduces = any(isinstance(s, Part) and s.op in REDUCED_IN_WIDER and s != d and n > 1
                  for s, d, n in zip(src, dst, sizes))
    return reduce_dtype if reduces else None


def plan_transition(src: Sequence[Pl], dst: Sequence[Pl], shape: Sequence[Dim], mesh: MeshLike,
                    dtype: torch.dtype) -> list[Step]:
    """The steps turning a tensor of global ``shape`` laid out as ``src`` into ``dst`` on this rank.

    Requires one placement per mesh axis in ``src`` and ``dst``; ``mesh`` gives the axis sizes and
    this rank's coordinates (uneven splits have rank-dependent local shapes). Ensures: applying the
    steps in order (``collectives.redistribute_nodes``) yields ``dst``; an axis of one rank or an
    unchanged placement has no step. A Partial sum of a float narrower than the mesh's ``reduce_dtype``
    (``MeshInfo.reduce_dtype``, set under ``torch.autocast``) is reduced in that dtype: the whole change
    runs in it, between two casts.
    """
    sizes, coords = mesh.sizes, mesh.coords
    wide = WIDEN.get(dtype) or _reduce_in(src, dst, sizes, dtype, getattr(mesh, "reduce_dtype", None))
    if wide is not None and _communicates(src, dst, sizes):
        return [Step("cast", dtype=wide), *plan_transition(src, dst, shape, mesh, wide), Step("cast", dtype=dtype)]
    itemsize = dtype.itemsize
    cur = list(src)
    steps: list[Step] = []

    def add(kind: str, a: int, s: Pl, d: Pl, lshape: tuple, nbytes: Optional[int] = None,
            gsize: Optional[Dim] = None) -> None:
        size = hint(prod(lshape)) * itemsize if nbytes is None else nbytes
        s, d = (local_outer([p if i == a else q for i, q in enumerate(cur)], sizes, a) for p in (s, d))
        steps.append(Step(kind, a, s, d, lshape, size, gsize))

    def gather(a: int, s: S) -> None:  # all_gather the split ``s`` on axis ``a`` (padded pieces when uneven)
        lshape = tuple(local_shape(shape, cur, sizes, coords))
        after = [R if i == a else q for i, q in enumerate(cur)]
        gsize = local_shape(shape, after, sizes, coords)[s.dim]
        piece = ceil_div(int(gsize), sizes[a]) if is_uneven(gsize, sizes[a]) else lshape[s.dim]
        nbytes = hint(prod([piece if i == s.dim else x for i, x in enumerate(lshape)])) * itemsize * sizes[a]
        add("all_gather", a, s, R, lshape, nbytes, gsize)
        cur[a] = R

    def plain(p: Pl, k: int) -> bool:
        return isinstance(p, S) and p.outer == 1 and p.dim == k

    def outer_fixed(a: int, k: int) -> bool:
        # splitting dim k on axis a in place (reduce_scatter, all_to_all) gives mesh-major pieces only if
        # every outer axis already cuts k as it will in the end (or never touches it)
        def cuts(p: Pl) -> bool:
            return isinstance(p, S) and p.dim == k

        return all(cur[b] == dst[b] for b in range(a) if sizes[b] > 1 and (cuts(cur[b]) or cuts(dst[b])))

    for a in reversed(range(len(cur))):
        s, d = cur[a], dst[a]
        if s == d or sizes[a] == 1:  # on a one-rank axis every layout holds the same data
            cur[a] = d
            continue
        n = sizes[a]
        # pieces of a dim split on several axes are mesh-major: an axis may only gain or lose its plain split
        # of a dim once no inner axis splits that dim, so such inner splits are gathered first (and re-sliced
        # below, after this axis's split)
        for k in {p.dim for p in (s, d) if isinstance(p, S) and p.outer == 1}:
            for b in reversed(range(a + 1, len(cur))):  # innermost first
                if plain(cur[b], k) and sizes[b] > 1:
                    gather(b, cur[b])
        lshape = tuple(local_shape(shape, cur, sizes, coords))
        if isinstance(s, Part):
            if isinstance(d, S) and s.op == "sum" and outer_fixed(a, d.dim):
                add("reduce_scatter", a, s, d, lshape)
                cur[a] = d
                continue
            add("all_reduce", a, s, R, lshape)
        elif _can_all_to_all(s, d, a, cur, lshape, shape, n) and outer_fixed(a, d.dim):
            add("all_to_all", a, s, d, lshape)
            cur[a] = d
            continue
        elif isinstance(s, S):
            gather(a, s)
        cur[a] = R
    for a in range(len(cur)):
        s, d = cur[a], dst[a]
        if s == d or sizes[a] == 1:
            cur[a] = d
            continue
        lshape = tuple(local_shape(shape, cur, sizes, coords))
        if isinstance(d, S):
            add("slice", a, s, d, lshape)
        elif isinstance(d, Part):
            add("to_partial", a, s, d, lshape)
        cur[a] = d
    return steps
